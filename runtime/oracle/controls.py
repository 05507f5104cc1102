"""The oracle's negative controls, run on the compiled path: each breaks one DeepStack
branch for real and must be detected, or the oracle fails.

- zeroed_branch: the compiled diagnostics graph runs again (the same cached artifact, a
  second session) over the checkpoint's weights with `deepstack_merger_list.K.*` zeroed;
  every stage is compared with the reference under the run's tolerances, and the
  branch's output must fail (the report lists every failing stage: in a passing run,
  only the branch's own).
- dropped_branch: the compiled graph's outputs are packaged as a prefill payload
  (`runtime.inputs.prefill.build_prefill_payload`, what a language model consumes) once whole,
  which must be accepted, and once with the last branch missing, which must be refused.
"""

from __future__ import annotations

import numpy as np

from emitter.config import HF_PREFIX, VisionConfig
from emitter.text_config import TokenIds

from runtime.oracle.compare import actuals, compare_stages

CONTROL_KINDS = ("zeroed_branch", "dropped_branch")


def not_applicable() -> list[dict]:
    """The controls of a model with no DeepStack branch: nothing to break."""
    return [{"kind": kind, "ran_on": None, "branch": None, "detected": None, "first_failing_stage": None,
             "description": "not applicable: the model has no DeepStack mergers"} for kind in CONTROL_KINDS]


def zeroed_weights(weights: dict[str, np.ndarray], branch: int) -> dict[str, np.ndarray]:
    """A copy of the weight dict with every `deepstack_merger_list.<branch>.*` tensor zeroed
    (the others shared, not copied)."""
    prefix = f"{HF_PREFIX}deepstack_merger_list.{branch}."
    zeroed = {n: np.zeros_like(w) if n.startswith(prefix) else w for n, w in weights.items()}
    if not any(n.startswith(prefix) for n in weights):
        raise ValueError(f"no weights named {prefix}*: cannot zero DeepStack branch {branch}")
    return zeroed


def zeroed_branch(cfg: VisionConfig, graph: dict[str, np.ndarray], expected: dict, names, tol: dict,
                  branch: int) -> dict:
    """The control's entry from the zeroed run's graph results (ABI names): detected when
    the branch's output fails; every failing stage listed, the first one named."""
    stem = f"deepstack_merger_list.{branch}"
    entries = compare_stages(cfg, actuals(cfg, graph), expected, names, tol)
    failing = [c["stage"] for c in entries if not c["pass"]]
    return {"kind": "zeroed_branch", "ran_on": "compiled", "branch": branch,
            "description": f"the compiled graph run again with the weights {HF_PREFIX}{stem}.* zeroed",
            "detected": stem in failing, "first_failing_stage": failing[0] if failing else None,
            "failing_stages": failing}


# The control's own token ids: it only packages outputs, no tokenizer or language model reads them.
CONTROL_IDS = TokenIds(image_token_id=3, video_token_id=4, vision_start_token_id=1, vision_end_token_id=2)


def _prompt(grid_thw, merge_size: int) -> np.ndarray:
    """A chat-template-like prompt: one <|vision_start|><|image_pad|><|vision_end|> per
    image (`CONTROL_IDS`), text tokens around them, pads expanded to each image's merged count."""
    from runtime.inputs.prefill import expand_image_pads
    text = [5, 6]  # any text tokens
    ids = list(text)
    for _ in range(len(grid_thw)):
        ids += [CONTROL_IDS.vision_start_token_id, CONTROL_IDS.image_token_id, CONTROL_IDS.vision_end_token_id] + text
    return expand_image_pads(np.array(ids, np.int64), grid_thw, merge_size, token_ids=CONTROL_IDS)


def dropped_branch(cfg: VisionConfig, graph: dict[str, np.ndarray], grid_thw) -> dict:
    """Package the compiled outputs as a prefill payload, whole and with the last DeepStack
    branch missing: detected when the whole payload is accepted and the other refused."""
    from runtime.inputs.prefill import PrefillError, build_prefill_payload
    k = len(cfg.deepstack_visual_indexes)
    branch = k - 1
    ids = _prompt(grid_thw, cfg.spatial_merge_size)
    features = [graph[f"deepstack_features.{j}"] for j in range(k)]
    entry = {"kind": "dropped_branch", "ran_on": "compiled", "branch": branch,
             "description": f"the compiled outputs packaged as a prefill payload with deepstack_features.{branch} "
                            "missing", "refused_by": "runtime.inputs.prefill.build_prefill_payload"}
    try:
        build_prefill_payload(ids, graph["image_embeds"], features, grid_thw, k, cfg.spatial_merge_size,
                              token_ids=CONTROL_IDS)
    except PrefillError as e:  # the intact payload must go through, or the control proves nothing
        return {**entry, "detected": False, "first_failing_stage": None, "error": f"intact payload refused: {e}"}
    try:
        build_prefill_payload(ids, graph["image_embeds"], features[:branch] + [None], grid_thw, k,
                              cfg.spatial_merge_size, token_ids=CONTROL_IDS)
    except PrefillError as e:
        return {**entry, "detected": True, "first_failing_stage": f"deepstack_merger_list.{branch}",
                "error": str(e)}
    return {**entry, "detected": False, "first_failing_stage": None, "error": None}
