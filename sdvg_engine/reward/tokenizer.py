"""BLIP/ImageReward text tokenizer built from a local bert-base-uncased ``vocab.txt`` only.

ImageReward calls ``BertTokenizer.from_pretrained('bert-base-uncased')`` and then adds ``[DEC]``
(bos) and ``[ENC]`` (additional special token), giving 30524 ids. We never touch the Hub:
transformers 5 *silently* returns a 5-token tokenizer when offline (every word -> [UNK]), so the
vocabulary is shipped with the package and the result is checked (size and a canary prompt).

Note on the first id: ImageReward's ``score``/``inference_rank``/``score_gard`` (and training)
feed the tokenizer output unchanged, i.e. the sequence starts with ``[CLS]`` (101). BLIP's ITM
head replaces it with ``[ENC]`` (30523), but ImageReward never does, so neither do we.
"""

from __future__ import annotations

import hashlib
import inspect
from importlib import resources
from pathlib import Path

import torch

__all__ = [
    "MAX_TEXT_LENGTH",
    "VOCAB_SHA256",
    "EXPECTED_VOCAB_SIZE",
    "BlipTokenizer",
    "default_vocab_path",
]

#: ImageReward tokenises prompts with padding="max_length", truncation=True, max_length=35.
MAX_TEXT_LENGTH = 35
#: sha256 of the bert-base-uncased vocab.txt shipped in this package (30522 lines).
VOCAB_SHA256 = "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3"
#: 30522 WordPiece tokens + [DEC] + [ENC].
EXPECTED_VOCAB_SIZE = 30524
_CANARY = ("a photo of a cat", [101, 1037, 6302, 1997, 1037, 4937, 102])


def default_vocab_path() -> Path:
    """Path of the packaged ``vocab.txt``."""
    return Path(str(resources.files("sdvg_engine.reward").joinpath("vocab.txt")))


def _read_vocab(path: Path) -> dict[str, int]:
    with open(path, encoding="utf-8") as f:
        return {line.rstrip("\n"): i for i, line in enumerate(f)}


def _build_bert_tokenizer(path: Path):
    """Construct transformers' BertTokenizer from a local vocab on transformers 4.x and 5.x.

    4.x: ``BertTokenizer(vocab_file=...)`` (slow, Python WordPiece).
    5.x: BertTokenizer is the tokenizers-backed class, takes ``vocab=`` (a dict) and silently
    ignores ``vocab_file=``; so we pick the argument from the signature.
    """
    from transformers import BertTokenizer

    params = inspect.signature(BertTokenizer.__init__).parameters
    if "vocab_file" in params:
        return BertTokenizer(vocab_file=str(path), do_lower_case=True)
    return BertTokenizer(vocab=_read_vocab(path), do_lower_case=True)


class BlipTokenizer:
    """Tokenises prompts exactly like ImageReward: ``[CLS] ... [SEP]`` padded to 35 tokens.

    ``__call__(prompt) -> (input_ids [1, 35] long, attention_mask [1, 35] long)`` on CPU.
    """

    def __init__(self, vocab_file: str | Path | None = None, *, check_hash: bool | None = None):
        path = Path(vocab_file) if vocab_file is not None else default_vocab_path()
        if not path.is_file():
            raise FileNotFoundError(
                f"BERT vocab file not found: {path}. The packaged sdvg_engine/reward/vocab.txt "
                "(bert-base-uncased) is used when vocab_file is None; nothing is downloaded."
            )
        # The packaged file must be the exact bert-base-uncased vocab; a user-supplied file is
        # only checked functionally (size + canary ids) unless check_hash=True.
        if check_hash is None:
            check_hash = vocab_file is None
        if check_hash:
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            if digest != VOCAB_SHA256:
                raise ValueError(
                    f"{path}: sha256 {digest} is not the bert-base-uncased vocab ({VOCAB_SHA256})"
                )
        self.vocab_file = path
        tok = _build_bert_tokenizer(path)
        # Same additions as BLIP's init_tokenizer(): bos [DEC] = 30522, extra special [ENC] = 30523.
        tok.add_special_tokens({"bos_token": "[DEC]"})
        tok.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
        if len(tok) != EXPECTED_VOCAB_SIZE:
            raise ValueError(
                f"tokenizer built from {path} has {len(tok)} tokens, expected "
                f"{EXPECTED_VOCAB_SIZE} (30522 bert-base-uncased WordPieces + [DEC] + [ENC]). "
                "Is the vocab file complete, and did this transformers version read it?"
            )
        self._tok = tok
        self.dec_token_id = int(tok.convert_tokens_to_ids("[DEC]"))
        self.enc_token_id = int(tok.convert_tokens_to_ids("[ENC]"))
        ids = self.encode_ids(_CANARY[0])
        if ids != _CANARY[1]:
            raise ValueError(
                f"tokenizer built from {path} maps {_CANARY[0]!r} to {ids}, expected "
                f"{_CANARY[1]}: wrong vocab or incompatible transformers tokenizer"
            )

    def __len__(self) -> int:
        return len(self._tok)

    def encode_ids(self, prompt: str) -> list[int]:
        """Unpadded ids including [CLS]/[SEP], truncated to 35."""
        return list(
            self._tok(prompt, truncation=True, max_length=MAX_TEXT_LENGTH)["input_ids"]
        )

    def __call__(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        enc = self._tok(
            prompt,
            padding="max_length",
            truncation=True,
            max_length=MAX_TEXT_LENGTH,
            return_tensors="pt",
        )
        return enc["input_ids"].long(), enc["attention_mask"].long()
