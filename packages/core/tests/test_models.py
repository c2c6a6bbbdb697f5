import pytest
import torch
from memfit.errors import MemfitError
from memfit.models import PRESETS, Llama, LlamaConfig, SyntheticTokens, build_training


def test_presets_have_published_sizes():
    assert round(LlamaConfig.preset("llama2-7b").num_parameters() / 1e9, 2) == 6.74
    assert round(LlamaConfig.preset("llama3-8b").num_parameters() / 1e9, 2) == 8.03
    assert {"tiny", "small", "medium", "llama2-7b", "llama3-8b"} <= set(PRESETS)


def test_num_parameters_matches_the_built_model():
    for name in ("tiny", "small"):
        config = LlamaConfig.preset(name)
        assert sum(p.numel() for p in Llama(config).parameters()) == config.num_parameters()


def test_grouped_query_attention_and_shapes():
    config = LlamaConfig.preset("tiny")
    assert config.n_heads // config.n_kv_heads == 2
    model = Llama(config)
    assert model.layers[0].attention.wk.weight.shape == (config.n_kv_heads * config.head_dim, config.dim)
    logits = model(torch.zeros(2, 16, dtype=torch.long))
    assert logits.shape == (2, 16, config.vocab_size)


def test_big_presets_build_on_the_meta_device():
    with torch.device("meta"):
        model = Llama(LlamaConfig.preset("llama2-7b"))
    assert sum(p.numel() for p in model.parameters()) == LlamaConfig.preset("llama2-7b").num_parameters()


def test_bad_configs_are_clear():
    with pytest.raises(MemfitError, match="unknown model preset 'huge'"):
        LlamaConfig.preset("huge")
    with pytest.raises(MemfitError, match="multiple of n_kv_heads"):
        LlamaConfig(n_heads=4, n_kv_heads=3)
    with pytest.raises(MemfitError, match="exceeds the model's max_seq_len"):
        Llama(LlamaConfig.preset("tiny"))(torch.zeros(1, 1000, dtype=torch.long))


def test_synthetic_data_is_deterministic_and_shifted():
    data = SyntheticTokens(vocab_size=97, seq_len=16, batch_size=3, seed=5)
    x, y = data.batch(7)
    x2, y2 = SyntheticTokens(vocab_size=97, seq_len=16, batch_size=3, seed=5).batch(7)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(x[:, 1:], y[:, :-1]) and int(x.max()) < 97
    assert not torch.equal(data.batch(8)[0], x)


def test_training_is_reproducible_and_learns():
    a = build_training("tiny", batch=4, seq=32, seed=1)
    b = build_training("tiny", batch=4, seq=32, seed=1)
    losses_a = [a.step() for _ in range(30)]
    losses_b = [b.step() for _ in range(30)]
    assert losses_a == losses_b
    assert sum(losses_a[-5:]) / 5 < sum(losses_a[:5]) / 5 - 0.5
