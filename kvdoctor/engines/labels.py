"""How engines are named: the key a rule's fix knobs use for each engine name a capture may
carry, and the label people read."""

ENGINE_KNOB = {"vllm": "vllm", "sglang": "sglang", "tgi": "tgi", "llamacpp": "llamacpp", "llama.cpp": "llamacpp",
               "trtllm": "trtllm", "tensorrt-llm": "trtllm", "triton": "trtllm"}
ENGINE_LABEL = {"vllm": "vLLM", "sglang": "SGLang", "tgi": "TGI", "llamacpp": "llama.cpp", "trtllm": "TensorRT-LLM", "any": "any engine"}
