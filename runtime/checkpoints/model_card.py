"""A checkpoint's Hugging Face model card (README.md): what its front matter says the model is."""

from __future__ import annotations

from pathlib import Path


def front_matter(model_dir) -> list[str]:
    """README.md's front matter (the YAML block between its first two `---` lines), each line
    stripped and lower-cased; [] where there is none."""
    path = Path(model_dir) / "README.md"
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    if not lines or lines[0].strip() != "---":
        return []
    head = []
    for line in lines[1:200]:
        if line.strip() == "---":
            break
        head.append(line.strip().lower())
    return head


def card_names(model_dir, pipeline_tag: str, word: str) -> bool:
    """Whether the card's front matter names the model so: `pipeline_tag: <pipeline_tag>`, or
    a tag (a `- ` item, or an inline `tags:` line) holding `word`."""
    return any(line.replace(" ", "") == f"pipeline_tag:{pipeline_tag}" or
               (line.startswith(("- ", "tags:")) and word in line) for line in front_matter(model_dir))
