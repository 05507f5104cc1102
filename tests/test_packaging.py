"""The templates ship with the package: a built, non-editable wheel emits too, and serves the
chat page's files (runtime/serve/web/)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_installed_wheel_emits(tmp_path):
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(ROOT)],
                   check=True, capture_output=True)
    (wheel,) = wheels.glob("*.whl")
    subprocess.run([*pip, "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    code = ("import emitter, sys; from emitter.config import PRESETS; from emitter.vision import emit_vision_module;"
            "assert emitter.__file__.startswith(sys.argv[1]), emitter.__file__;"
            "print(emit_vision_module(PRESETS['tiny'], 8).count('stablehlo.dot_general'))")
    env = dict(os.environ, PYTHONPATH=str(target))
    result = subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True, text=True,
                            cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) > 10
    page = ("import sys; from runtime.serve import webui; assert webui.__file__.startswith(sys.argv[1]), webui.__file__;"
            "print(' '.join(sorted(webui.page_files())))")
    result = subprocess.run([sys.executable, "-c", page, str(target)], capture_output=True, text=True,
                            cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    web = ROOT / "runtime" / "serve" / "web"
    shipped = sorted(p.name for p in web.iterdir() if p.suffix in (".html", ".js", ".css"))
    assert result.stdout.split() == shipped
