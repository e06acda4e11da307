import json
from collections import Counter

from raylora.model.tiny import BOS, EOS, bytes_to_unicode, learn_bpe


def test_bytes_to_unicode_is_a_printable_bijection():
    m = bytes_to_unicode()
    assert len(m) == 256 and len(set(m.values())) == 256
    assert all(not c.isspace() for c in m.values())
    assert m[ord("a")] == "a" and m[ord(" ")] != " "


def test_bpe_merges_are_deterministic_and_frequency_ordered():
    words = Counter({"low": 5, "lower": 2, "newest": 6, "widest": 3})
    merges = learn_bpe(words, 10)
    assert merges == learn_bpe(words, 10)
    assert merges[0] == ("s", "t</w>")  # in "newest"×6 + "widest"×3, the most frequent pair


def test_tiny_tokenizer_is_clip_shaped(tiny_model):
    from transformers import CLIPTokenizer

    tok = CLIPTokenizer.from_pretrained(tiny_model, subfolder="tokenizer")
    assert tok.model_max_length == 77
    assert tok.bos_token == BOS and tok.eos_token == EOS and tok.pad_token == EOS
    ids = tok("a red circle").input_ids
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    # Demo caption words are whole tokens thanks to the learned merges.
    assert tok.convert_ids_to_tokens(ids[1:-1]) == ["a</w>", "red</w>", "circle</w>"]
    # Unseen text still tokenizes (byte fallback) and decodes back.
    assert tok.decode(tok("zebra xylophone!").input_ids, skip_special_tokens=True) == "zebra xylophone !"
    te_cfg = json.load(open(f"{tiny_model}/text_encoder/config.json"))
    assert te_cfg["vocab_size"] == len(tok) and te_cfg["eos_token_id"] == tok.eos_token_id
