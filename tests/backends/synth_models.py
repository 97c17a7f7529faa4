"""CpuModels over tiny synth GGUF files, for the CPU-backend tests."""
from strata.backends.cpu import CpuModel
from strata.model.gguf_file import GGUFModel
from strata.tool.synth import synth_model


def synth_cpu_models(root, variants: dict[str, dict]) -> dict[str, CpuModel]:
    """name -> CpuModel of `synth_model(root / name.gguf, **kwargs)` for each variant."""
    out = {}
    for name, kwargs in variants.items():
        path = root / f"{name}.gguf"
        synth_model(path, **kwargs)
        out[name] = CpuModel(GGUFModel.open(path))
    return out
