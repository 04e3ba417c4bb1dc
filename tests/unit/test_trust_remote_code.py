"""``model.trust_remote_code``: a local model folder whose tokenizer is custom Python code (``auto_map`` in
tokenizer_config.json, as Moonlight's tiktoken tokenizer) loads only with the flag, and the flag reaches the vLLM
engine's ``LLM(...)`` arguments. The folder is written here: no download."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOKENIZER_CODE = '''
from transformers import PreTrainedTokenizer


class LetterTokenizer(PreTrainedTokenizer):
    """One id per character of a fixed alphabet."""

    ALPHABET = "<>abcdefghijklmnopqrstuvwxyz0123456789= "

    def __init__(self, **kw):
        self._vocab = {c: i for i, c in enumerate(self.ALPHABET)}
        super().__init__(**kw)

    @property
    def vocab_size(self):
        return len(self._vocab)

    def get_vocab(self):
        return dict(self._vocab)

    def _tokenize(self, text):
        return list(text)

    def _convert_token_to_id(self, token):
        return self._vocab[token]

    def _convert_id_to_token(self, index):
        return self.ALPHABET[index]
'''


def _folders(tmp_path) -> tuple[str, str]:
    """An HF model folder (the tiny model's config.json, no weights needed here) and a tokenizer folder of custom
    code (apart: with a config.json beside it transformers falls back to the config's tokenizer class instead)."""
    from megatron_rlvr.families.tiny import tiny_hf_config

    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config()))
    tok = tmp_path / "tokenizer"
    tok.mkdir()
    (tok / "letter_tokenizer.py").write_text(TOKENIZER_CODE)
    (tok / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "LetterTokenizer",
                "auto_map": {"AutoTokenizer": ["letter_tokenizer.LetterTokenizer", None]},
                "eos_token": ">",
                "bos_token": "<",
            }
        )
    )
    return str(tmp_path), str(tok)


def test_the_flag_loads_a_custom_code_tokenizer(tmp_path):
    """Without the flag the folder's tokenizer is refused (transformers asks for trust_remote_code); with it the
    custom class loads and encodes as its code says (hand-computed ids: a=2, b=3, '='=38, '3'=31)."""
    from megatron_rlvr.config import ModelConfig
    from megatron_rlvr.models.source import load_tokenizer, resolve_model_source

    folder, tok_dir = _folders(tmp_path)
    plain = resolve_model_source(ModelConfig(name="custom", hf_path=folder, tokenizer=tok_dir))
    assert plain.trust_remote_code is False
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        load_tokenizer(plain)
    source = resolve_model_source(ModelConfig(name="custom", hf_path=folder, tokenizer=tok_dir, trust_remote_code=True))
    tok = load_tokenizer(source)
    assert type(tok).__name__ == "LetterTokenizer"
    assert tok("ab=3", add_special_tokens=False).input_ids == [2, 3, 38, 31] and tok.eos_token_id == 1


def test_the_flag_is_validated_and_defaults_off():
    """A non-boolean value is refused in one line naming the field; the default is off."""
    from megatron_rlvr.config import ModelConfig

    assert ModelConfig().trust_remote_code is False
    with pytest.raises(ValueError, match="model.trust_remote_code must be true or false, got 'yes'"):
        ModelConfig(trust_remote_code="yes")


@pytest.mark.parametrize("flag", [False, True])
def test_the_flag_reaches_the_vllm_engine(tmp_path, monkeypatch, flag):
    """The vLLM engine's ``LLM(...)`` keyword arguments carry ``trust_remote_code=True`` exactly when the run sets it
    (the engine class is replaced by a recorder: vLLM itself is not started)."""
    from megatron_rlvr.config import load_run_config
    from megatron_rlvr.models.source import resolve_model_source
    from megatron_rlvr.trainer import engine_setup

    folder, tok_dir = _folders(tmp_path)
    overrides = [f"model.hf_path={folder}", f"model.tokenizer={tok_dir}", f"model.trust_remote_code={flag}"]
    cfg = load_run_config(None, overrides)
    assert cfg.model.trust_remote_code is flag
    seen = {}

    def recorder(hf_config, **kw):
        seen.update(kw)
        return "engine"

    monkeypatch.setattr(engine_setup, "VLLMRolloutEngine", recorder)
    source = resolve_model_source(cfg.model)
    assert engine_setup._vllm_engine(cfg, source, None, None) == "engine"
    assert seen["tokenizer"] == tok_dir
    assert seen["config"].extra_llm_kwargs.get("trust_remote_code", False) is flag
