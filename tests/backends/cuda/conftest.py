"""Shared setup of the CUDA-backend tests: one GPU runtime and synth models per session."""
import pytest

from strata.tool.synth import synth_model

from cuda_synth import synth_overrides


@pytest.fixture(scope="session")
def synth_path(tmp_path_factory):
    """synth_path(shape, weight_type) -> path of that synth GGUF (written once a session)."""
    root = tmp_path_factory.mktemp("cuda-synth")
    made = {}

    def make(shape: str, weight_type: str):
        key = (shape, weight_type)
        if key not in made:
            path = root / f"{shape}-{weight_type}.gguf"
            synth_model(path, shape=shape, weight_type=weight_type,
                        **synth_overrides(shape, weight_type))
            made[key] = path
        return made[key]

    return make


@pytest.fixture(scope="session")
def runtime():
    from strata.backends.cuda.runtime import Runtime

    return Runtime()
