"""Tiny models made by our own code, once per test run."""

from __future__ import annotations

import pytest

from prepos.backends import llama_cpp
from prepos.config import EngineConfig, GateConfig
from prepos.engine import Engine
from prepos.lab.tiny import build_model
from tests.support.models import BACKENDS, FAMILIES, NO_LLAMA_CPP, backend_config


def pytest_report_header(config):
    return None if llama_cpp.available() else NO_LLAMA_CPP


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {fam: build_model(root / f"{fam}-{arch}", fam, arch, seed=1)
            for fam, arch in FAMILIES}


@pytest.fixture(scope="session")
def model(model_dirs) -> str:
    """The served model id of a server on the chatml tiny model (its directory's name)."""
    return model_dirs["chatml"].name


@pytest.fixture(scope="session")
def tok(model_dirs):
    """The chatml tiny model's tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dirs["chatml"]))


@pytest.fixture
def oai(server):
    """An OpenAI SDK client of the module's `server` fixture (a `ServerProc`)."""
    import openai

    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(params=[f for f, _ in FAMILIES])
def family(request):
    return request.param


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Each of BACKENDS: the engine's tests run on all three."""
    backend_config(request.param)
    return request.param


@pytest.fixture
def make_engine(model_dirs, backend):
    engines = []

    def make(family: str = "chatml", **overrides) -> Engine:
        cfg = EngineConfig(**{"gate": GateConfig(tau=0.0, answers=()), "threads": 2,
                              **backend_config(backend), **overrides})
        eng = Engine.from_pretrained(model_dirs[family], cfg)
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        eng.close()
