"""/tokenize and /detokenize (vLLM's shapes) on a proxy without nodes: the ids are the tokenizer's own (the oracle is
transformers: encode, apply_chat_template, decode), a chat's tools are rendered as the template renders them, and bad
input is a 400 naming the field."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.api.app import create_app
from proxy.api.auth import APIKeys
from proxy.api.serving import ProxyState
from tests.unit.test_openai_api import ScriptedPipeline

MESSAGES = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is the weather?"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
# a template that renders tools itself, as Qwen's and Llama 3.1's do
TOOLS_TEMPLATE = ("{% if tools %}<|im_start|>tools\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
                  "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
                  "'<|im_end|>\n' }}{% endfor %}"
                  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module")
def tools_tokenizer_dir(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny tokenizer with a chat template that renders tools."""
    out = tmp_path_factory.mktemp("tools-tokenizer")
    for path in tokenizer_dir.iterdir():
        shutil.copy(path, out / path.name)
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TOOLS_TEMPLATE}))
    return out


@pytest.fixture(scope="module")
def tokenizer(tools_tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tools_tokenizer_dir))


@pytest.fixture
def state(tokenizer: Any) -> Iterator[ProxyState]:
    state = ProxyState(ScriptedPipeline([5]), tokenizer, "m", max_model_len=256)
    yield state
    state.close()


def post(state: ProxyState, *requests: tuple[str, Any], headers: dict[str, str] | None = None) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        app = create_app(state)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as http:
            return [await http.post(path, json=body, headers=headers) for path, body in requests]

    return asyncio.run(run())


def test_a_prompt_is_tokenized_as_the_tokenizer_encodes_it_with_its_token_strings(state: ProxyState, tokenizer: Any
                                                                                  ) -> None:
    text = "héllo wörld, the license"
    plain, with_strs = post(state, ("/tokenize", {"prompt": text}),
                            ("/tokenize", {"model": "m", "prompt": text, "return_token_strs": True}))
    expected = tokenizer.encode(text)
    assert plain.status_code == 200
    assert plain.json() == {"count": len(expected), "max_model_len": 256, "tokens": expected, "token_strs": None}
    assert with_strs.json()["token_strs"] == tokenizer.convert_ids_to_tokens(expected)


def test_a_chat_is_tokenized_as_apply_chat_template_renders_it_tools_included(state: ProxyState, tokenizer: Any
                                                                             ) -> None:
    (response,) = post(state, ("/tokenize", {"messages": MESSAGES, "tools": [TOOL]}))
    text = tokenizer.apply_chat_template(MESSAGES, tools=[TOOL], tokenize=False, add_generation_prompt=True)
    assert "get_weather" in text
    expected = tokenizer.encode(text, add_special_tokens=False)
    assert response.status_code == 200, response.text
    assert response.json()["tokens"] == expected and response.json()["count"] == len(expected)


def test_a_chat_without_the_generation_prompt_or_continuing_its_last_message(state: ProxyState, tokenizer: Any
                                                                            ) -> None:
    partial = [*MESSAGES, {"role": "assistant", "content": "It is"}]
    without, continued = post(state, ("/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}),
                              ("/tokenize", {"messages": partial, "continue_final_message": True}))
    for response, messages, kwargs in [(without, MESSAGES, {"add_generation_prompt": False}),
                                       (continued, partial, {"continue_final_message": True})]:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        assert response.json()["tokens"] == tokenizer.encode(text, add_special_tokens=False), response.text


def test_detokenize_gives_the_tokenizers_text_of_the_ids(state: ProxyState, tokenizer: Any) -> None:
    ids = tokenizer.encode("<|im_start|>user\nnaïve façade 🙂")
    (response,) = post(state, ("/detokenize", {"tokens": ids}))
    assert response.status_code == 200 and response.json() == {"prompt": tokenizer.decode(ids)}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 7}, "prompt"),
    ("/tokenize", {"prompt": "x", "add_generation_prompt": True}, "add_generation_prompt"),  # a chat's field
    ("/tokenize", {"prompt": "x", "return_token_strs": "yes"}, "return_token_strs"),
    ("/tokenize", {"messages": MESSAGES, "mm_processor_kwargs": {}}, "mm_processor_kwargs"),
    ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ messages }}"}, "chat_template"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ("/tokenize", {"messages": MESSAGES, "tools": [{"type": "web_search"}]}, "tools"),
    ("/detokenize", {"tokens": [1, 1000]}, "tokens"),  # the tiny vocabulary has 1000 tokens
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": [1, True]}, "tokens"),
    ("/detokenize", {"tokens": [10**400, 1e300]}, "tokens"),  # no float holds the first
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ("/detokenize", {"tokens": [1], "skip_special_tokens": True}, "skip_special_tokens"),
])
def test_bad_input_is_a_400_naming_the_field(state: ProxyState, path: str, body: dict[str, Any], param: str) -> None:
    (response,) = post(state, (path, body))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_another_model_is_a_404_and_a_missing_key_a_401(state: ProxyState) -> None:
    other_prompt, other_chat, other_ids = post(state, ("/tokenize", {"model": "other", "prompt": "x"}),
                                               ("/tokenize", {"model": "other", "messages": MESSAGES}),
                                               ("/detokenize", {"model": "other", "tokens": [1]}))
    assert {r.status_code for r in (other_prompt, other_chat, other_ids)} == {404}
    assert other_prompt.json()["error"]["code"] == "model_not_found"
    state.api_keys = APIKeys(["secret"])
    refused, allowed = post(state, ("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]}))
    assert refused.status_code == allowed.status_code == 401
    (allowed,) = post(state, ("/detokenize", {"tokens": [1]}), headers={"Authorization": "Bearer secret"})
    assert allowed.status_code == 200
