"""Convert a model directory's PyTorch weights (pytorch_model.bin) to model.safetensors, once.

    python3 -m heads.convert MODEL_DIR

heads reads only safetensors (memory-mapped, validated); this writes MODEL_DIR/model.safetensors
from MODEL_DIR/pytorch_model.bin with the same tensor names. Needs torch and safetensors.
"""

import sys
from pathlib import Path


def convert(model_dir: str) -> Path:
    import torch
    from safetensors.torch import save_file

    d = Path(model_dir)
    src, dst = d / "pytorch_model.bin", d / "model.safetensors"
    if dst.exists():
        return dst
    if not src.exists():
        raise FileNotFoundError(f"{src}: not found (and no {dst.name})")
    state = torch.load(src, map_location="cpu", weights_only=True)
    tensors = {k: v.contiguous() for k, v in state.items() if isinstance(v, torch.Tensor)}
    tmp = dst.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.rename(dst)
    return dst


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(convert(sys.argv[1]))
