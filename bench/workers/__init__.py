"""Code that runs in a child process of its own: a native peer isolated from the benchmark (isolated) and ONNX
Runtime's side in its own environment (onnx_worker)."""
