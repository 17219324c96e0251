"""blink's benchmarks: `python -m bench NAME [options]` runs one (`python -m bench --list` names them), each through
one harness (bench/harness.py), its results in bench/results/; `python bench/report.py` prints them all."""
