"""`kvfleet tiny-model DIR`: a loadable checkpoint with a byte tokenizer and chat template."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet_engine import LLM, SamplingParams
from kvfleet_engine.tiny_model import main


def test_tiny_model_loads_chats_and_generates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "tiny"
    assert main([str(directory)]) == 0
    assert main([str(directory)]) == 2
    assert "is not empty (use --force to overwrite)" in capsys.readouterr().err
    llm = LLM(str(directory), device="cpu")
    assert llm.engine.model_config.max_model_len == 2048
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.encode("Hi") == [72, 105]  # one token per byte
    (output,) = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False
    )
    assert output.prompt == prompt
    assert output.prompt_token_ids[:3] == [258, 117, 115]  # <|im_start|> "u" "s": specials whole
    completion = output.outputs[0]
    assert len(completion.token_ids) == 5
    assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)


def test_an_uncreatable_directory_exits_2_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["/proc/nope"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("kvfleet tiny-model: cannot create /proc/nope: ")
