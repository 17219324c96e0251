"""The systems `python -m bench run` compares blink with: transformers' pipeline and `transformers serve` (decision),
llama.cpp (llamacpp), ONNX Runtime (onnxrt), blink on vLLM (vllm_arm) and the serving peers (throughput)."""
