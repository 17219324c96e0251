"""blink's benchmarks: `python -m bench NAME [options]` runs one (`python -m bench --list` names them), each a module
of this folder; what they share is in lib/, the systems they compare blink with in peers/, child-process code in
workers/. `python -m bench report FILE...` prints results files."""
