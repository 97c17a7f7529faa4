"""--device: the choices, CPU when asked, and auto/cuda on a machine without a usable GPU."""
import logging

import pytest
from click.testing import CliRunner

from strata.backends import cuda
from strata.backends.cpu import CpuModel
from strata.backends.select import build_model, check_device
from strata.cli import main
from strata.config import EngineConfig
from strata.errors import ConfigError
from strata.model.gguf_file import GGUFModel
from strata.tool.synth import synth_model

needs_no_gpu = pytest.mark.skipif(cuda.is_available(), reason="this machine has a usable GPU")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("select") / "tiny.gguf"
    synth_model(path, shape="tiny", weight_type="q8_0", n_layers=2)
    return path


@pytest.mark.parametrize("name, expected", [(None, "auto"), ("CPU", "cpu"), (" cuda ", "cuda")])
def test_device_names(name, expected):
    assert check_device(name) == expected


def test_an_unknown_device_is_refused(tiny_path):
    with pytest.raises(ConfigError, match=r"--device 'gpu' is not one of auto, cpu, cuda"):
        EngineConfig(tiny_path, device="gpu")


def test_cpu_is_the_cpu_backend(tiny_path):
    with GGUFModel.open(tiny_path) as gguf:
        assert isinstance(build_model(gguf, "cpu"), CpuModel)


@needs_no_gpu
def test_auto_without_a_gpu_runs_on_the_cpu_and_says_why(tiny_path, caplog):
    with caplog.at_level(logging.INFO, logger="strata.engine"), GGUFModel.open(tiny_path) as gguf:
        assert isinstance(build_model(gguf, "auto"), CpuModel)
    assert "device auto: the CPU (no usable CUDA GPU" in caplog.text


@needs_no_gpu
def test_cuda_without_a_gpu_says_what_is_missing(tiny_path):
    with GGUFModel.open(tiny_path) as gguf, pytest.raises(ConfigError, match="--device cpu"):
        build_model(gguf, "cuda")


@needs_no_gpu
def test_cuda_with_the_expert_tier_says_what_is_missing(tiny_path):
    # the expert options no longer keep the GPU away: only the missing CUDA does
    with GGUFModel.open(tiny_path) as gguf, pytest.raises(ConfigError, match="--device cpu"):
        build_model(gguf, "cuda", needs_cpu_experts=True)


@needs_no_gpu
def test_auto_with_an_expert_cache_and_no_gpu_is_the_cpu(tiny_path, caplog):
    with caplog.at_level(logging.INFO, logger="strata.engine"), GGUFModel.open(tiny_path) as gguf:
        assert isinstance(build_model(gguf, "auto", needs_cpu_experts=True), CpuModel)
    assert "device auto: the CPU (no usable CUDA GPU" in caplog.text


def test_cli_device_option(tiny_path):
    runner = CliRunner()
    bad = runner.invoke(main, ["bench", "--model", str(tiny_path), "--device", "gpu", "-p", "8",
                               "-n", "2", "-r", "1"])
    assert bad.exit_code == 2 and "'gpu' is not one of" in bad.output
    ok = runner.invoke(main, ["bench", "--model", str(tiny_path), "--device", "cpu", "-p", "8",
                              "-n", "2", "-r", "1"])
    assert ok.exit_code == 0, ok.output
    header = ok.output.splitlines()[0]
    assert "| backend |" in header
    assert "| cpu " in ok.output.splitlines()[2]


class _FakeRuntime:
    name = "Fake GPU"


def _fake_cuda(monkeypatch, dense_fits: bool):
    """CUDA 'available' with a GPU that cannot hold the whole model; its dense part fits when
    `dense_fits`. Records the CudaModel calls."""
    calls = []

    class FakeCudaModel:
        def __init__(self, gguf_model, experts_resident=True):
            calls.append(experts_resident)
            if experts_resident or not dense_fits:
                what = "the model's tensors" if experts_resident else "the dense part"
                raise ConfigError(f"{what} need 40.00 GiB of VRAM but Fake GPU has 8.00 GiB free")
            self.experts_resident, self.runtime = experts_resident, _FakeRuntime()

    monkeypatch.setattr(cuda, "unavailable_reason", lambda: None)
    monkeypatch.setattr(cuda, "CudaModel", FakeCudaModel)
    return calls


def test_auto_puts_a_moe_model_too_large_for_the_gpu_there_with_its_experts_in_ram(
        tiny_path, monkeypatch, caplog):
    calls = _fake_cuda(monkeypatch, dense_fits=True)
    config = EngineConfig(tiny_path)
    assert config.expert_cache is None
    with caplog.at_level(logging.INFO, logger="strata.engine"), GGUFModel.open(tiny_path) as gguf:
        model = build_model(gguf, "auto", config=config)
    assert calls == [True, False] and model.experts_resident is False
    assert config.expert_cache == "auto" and config.has_expert_tier  # the engine builds the tier
    assert "the GPU (Fake GPU) with the routed experts in pinned RAM" in caplog.text
    assert "--expert-cache auto" in caplog.text and "40.00 GiB" in caplog.text


def test_auto_runs_on_the_cpu_when_not_even_the_dense_part_fits(tiny_path, monkeypatch, caplog):
    calls = _fake_cuda(monkeypatch, dense_fits=False)
    config = EngineConfig(tiny_path)
    with caplog.at_level(logging.INFO, logger="strata.engine"), GGUFModel.open(tiny_path) as gguf:
        assert isinstance(build_model(gguf, "auto", config=config), CpuModel)
    assert calls == [True, False] and config.expert_cache is None
    assert "the CPU, since the GPU cannot hold the model" in caplog.text


@pytest.mark.parametrize("device, offload, with_config", [
    ("cuda", False, True),    # asked for the GPU as it is: its error, unchanged
    ("auto", True, True),     # the expert options asked already: no second try
    ("auto", False, False),   # no config to carry --expert-cache auto to the engine
])
def test_no_automatic_offload_otherwise(tiny_path, monkeypatch, device, offload, with_config):
    calls = _fake_cuda(monkeypatch, dense_fits=offload)
    config = EngineConfig(tiny_path) if with_config else None
    with GGUFModel.open(tiny_path) as gguf:
        if device == "cuda":
            with pytest.raises(ConfigError, match="40.00 GiB"):
                build_model(gguf, device, needs_cpu_experts=offload, config=config)
        else:
            model = build_model(gguf, device, needs_cpu_experts=offload, config=config)
            assert (model.experts_resident is False) if offload else isinstance(model, CpuModel)
    assert calls == [not offload]
    assert config is None or config.expert_cache is None


@pytest.mark.parametrize("mmap", [True, False])
def test_the_cpu_model_computes_from_the_map_or_a_copy_as_asked(tiny_path, mmap, caplog):
    with caplog.at_level(logging.INFO, logger="strata.engine"), GGUFModel.open(tiny_path) as gguf:
        build_model(gguf, "cpu", config=EngineConfig(tiny_path, device="cpu", mmap=mmap))
        assert gguf.in_memory is not mmap
    said = "served from the file's memory map" if mmap else "read into RAM, huge pages"
    assert f"model: weights {said}" in caplog.text


def test_the_map_is_the_default(tiny_path):
    assert EngineConfig(tiny_path).mmap is True
    with GGUFModel.open(tiny_path) as gguf:
        build_model(gguf, "cpu")
        assert not gguf.in_memory


def test_greedy_tokens_are_the_same_from_the_map_and_from_a_copy(tiny_path):
    from strata.engine.engine import Engine
    from strata.engine.generate import collect
    from strata.engine.sampling import SamplingParams

    tokens = []
    for mmap in (True, False):
        with Engine(EngineConfig(tiny_path, n_ctx=64, device="cpu", mmap=mmap)) as engine:
            assert engine.gguf.in_memory is not mmap
            params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
            tokens.append(collect(engine.generate([1, 5, 9, 13], params)).token_ids)
    assert tokens[0] == tokens[1] and len(tokens[0]) == 8


@pytest.mark.parametrize("available, refused", [(None, False), (1 << 20, True),
                                                (1 << 40, False)])
def test_no_mmap_is_refused_when_the_memory_is_not_free(tiny_path, monkeypatch,
                                                        available, refused):
    from strata.model import host_pages

    monkeypatch.setattr(host_pages, "available_bytes", lambda: available)
    config = EngineConfig(tiny_path, device="cpu", mmap=False)
    with GGUFModel.open(tiny_path) as gguf:
        if refused:
            with pytest.raises(ConfigError, match=r"--no-mmap: reading the weights into RAM "
                                                  r"needs 0\.\d+ GiB with headroom but 0\.00 "
                                                  r"GiB are available; .* leave --no-mmap out"):
                build_model(gguf, "cpu", config=config)
        else:
            build_model(gguf, "cpu", config=config)
        assert gguf.in_memory is not refused


def test_cli_mmap_options(tiny_path):
    runner = CliRunner()
    for flag in ("--mmap", "--no-mmap"):
        ok = runner.invoke(main, ["bench", "--model", str(tiny_path), "--device", "cpu", "-p",
                                  "8", "-n", "2", "-r", "1", flag])
        assert ok.exit_code == 0, ok.output
    bad = runner.invoke(main, ["bench", "--model", str(tiny_path), "--mmap=no"])
    assert bad.exit_code == 2


def test_mmap_must_be_a_bool(tiny_path):
    with pytest.raises(ConfigError, match=r"mmap must be True \(--mmap\) or False"):
        EngineConfig(tiny_path, mmap=None)
