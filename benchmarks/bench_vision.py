"""The vision bench lives in the package (runtime/bench/vision.py, `qwen3vl bench`); this file
runs it from a source checkout with the same options.

    .venv/bin/python benchmarks/bench_vision.py --preset qwen3-vl-2b --bucket 512 --precision both
"""

from runtime.commands.bench import bench_command

if __name__ == "__main__":
    bench_command()
