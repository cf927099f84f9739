"""The vectorised sampler against direct per-row references."""

import numpy as np
import pytest
import torch
from kvcore import InvalidArgumentError
from kvcore.engine.sampler import Sampler, mix_seed
from kvcore.params import SamplingParams
from kvcore_kernels import cpu_native

VOCAB = 50


def _sampler(*params, prompts=None):
    s = Sampler(VOCAB, seed=1)
    prompts = prompts or [[]] * len(params)
    slots = np.array([s.add(p, pr) for p, pr in zip(params, prompts, strict=True)])
    return s, slots


def _logits(rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g) * 3


def test_greedy_is_argmax_and_logprobs_are_raw():
    s, slots = _sampler(*[SamplingParams(temperature=0, logprobs=0)] * 4)
    logits = _logits(4)
    out = s.sample(logits, slots, np.zeros(4, np.int64))
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()
    ref = torch.log_softmax(logits, -1).gather(1, logits.argmax(-1, keepdim=True))[:, 0]
    np.testing.assert_allclose(out.logprobs, ref.numpy(), rtol=1e-6)
    assert out.top_ids is None


def test_greedy_bf16_logits_are_not_widened_and_give_the_same_tokens(monkeypatch):
    """Greedy rows only (no logprobs, penalties or temperature): bf16 logits go to the argmax as
    they are (the native one on the CPU, without an fp32 copy), with the fp32 answer, ties
    included; a row asking for logprobs brings the fp32 path back."""
    widened = []
    real_float = torch.Tensor.float

    def float_(self, *args, **kwargs):
        widened.append(self.shape)
        return real_float(self, *args, **kwargs)

    g = torch.Generator().manual_seed(3)
    logits = torch.randint(-3, 4, (6, VOCAB), generator=g).bfloat16()  # many ties
    s, slots = _sampler(*[SamplingParams(temperature=0)] * 6)
    monkeypatch.setattr(torch.Tensor, "float", float_)
    out = s.sample(logits, slots, np.zeros(6, np.int64))
    monkeypatch.setattr(torch.Tensor, "float", real_float)
    if cpu_native.available():  # without the extension NumPy's argmax widens (the old path)
        assert widened == []
    assert out.token_ids.tolist() == torch.argmax(logits.float(), -1).tolist()
    s2, slots2 = _sampler(SamplingParams(temperature=0, logprobs=0), *[SamplingParams()] * 5)
    out2 = s2.sample(logits, slots2, np.zeros(6, np.int64))
    assert out2.token_ids[0] == out.token_ids[0] and out2.logprobs is not None


def test_top_logprobs():
    s, slots = _sampler(SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0))
    logits = _logits(2)
    out = s.sample(logits, slots, np.zeros(2, np.int64))
    ref = torch.topk(torch.log_softmax(logits, -1), 3)
    assert out.top_ids[0].tolist() == ref.indices[0].tolist()
    np.testing.assert_allclose(out.top_logprobs[0], ref.values[0].numpy(), rtol=1e-6)


def test_temperature_sampling_follows_the_distribution():
    s, slots = _sampler(*[SamplingParams(temperature=0.7)] * 512)
    logits = torch.zeros(512, VOCAB)
    logits[:, :4] = torch.tensor([2.0, 1.0, 0.5, 0.0])
    counts = np.zeros(VOCAB)
    for step in range(20):
        out = s.sample(logits, slots, np.full(512, step))
        counts += np.bincount(out.token_ids, minlength=VOCAB)
    expected = torch.softmax(logits[0] / 0.7, -1).numpy() * counts.sum()
    # Large counts: each frequency within 5 standard deviations of the expectation.
    sd = np.sqrt(expected * (1 - expected / counts.sum())) + 1e-9
    assert np.all(np.abs(counts - expected) <= 5 * sd + 1)


def test_top_k_top_p_min_p_restrict_support():
    logits = _logits(1, seed=3).repeat(300, 1)
    order = logits[0].argsort(descending=True)
    probs = torch.softmax(logits[0], -1)
    for params, allowed in [
        (SamplingParams(top_k=1), order[:1]),
        (SamplingParams(top_k=3), order[:3]),
        (SamplingParams(top_p=1e-6), order[:1]),
        (SamplingParams(min_p=0.5), torch.nonzero(probs >= 0.5 * probs.max())[:, 0]),
    ]:
        s, slots = _sampler(*[params] * 300)
        got = set(s.sample(logits, slots, np.zeros(300, np.int64)).token_ids.tolist())
        assert got <= set(allowed.tolist()), params
    # top_p: the smallest prefix of ranked tokens whose mass reaches p.
    p = 0.6
    cum = torch.cumsum(probs[order], 0)
    keep = int(torch.searchsorted(cum, torch.tensor(p))) + 1
    s, slots = _sampler(*[SamplingParams(top_p=p)] * 300)
    got = set(s.sample(logits, slots, np.zeros(300, np.int64)).token_ids.tolist())
    assert got <= set(order[:keep].tolist()) and len(got) > 1


def _penalised_reference(logits, prompt, output, p):
    x = logits.clone()
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=VOCAB).float()
    seen = counts > 0
    if prompt:
        seen[torch.tensor(prompt)] = True
    x = torch.where(seen, torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


def test_penalties_match_reference_over_steps():
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.7),
        SamplingParams(temperature=0, frequency_penalty=1.5),
        SamplingParams(temperature=0, presence_penalty=2.0),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, repetition_penalty=0.8, frequency_penalty=-0.5),
    ]
    prompts = [[1, 2, 3], [4], [], [5], [6, 7]]
    s, slots = _sampler(*params, prompts=prompts)
    outputs = [[] for _ in params]
    for step in range(6):
        logits = _logits(len(params), seed=step) * 0.3
        got = s.sample(logits, slots, np.full(len(params), step)).token_ids
        for i, p in enumerate(params):
            ref = _penalised_reference(logits[i], prompts[i], outputs[i], p).argmax().item()
            assert got[i] == ref
            outputs[i].append(ref)


def test_seed_reproducible_whatever_the_batch():
    seeded = SamplingParams(temperature=1.0, seed=1234)
    s1, slots1 = _sampler(seeded)
    s2, slots2 = _sampler(SamplingParams(temperature=1.0), seeded, SamplingParams(temperature=2.0))
    a, b = [], []
    for step in range(30):
        logits = _logits(3, seed=100 + step)
        a.append(s1.sample(logits[1:2], slots1, np.array([step])).token_ids[0])
        b.append(s2.sample(logits, slots2, np.full(3, step)).token_ids[1])
    assert a == b
    s3, slots3 = _sampler(SamplingParams(temperature=1.0, seed=99))
    c = [
        s3.sample(_logits(3, seed=100 + t)[1:2], slots3, np.array([t])).token_ids[0]
        for t in range(30)
    ]
    assert c != a


def test_slots_are_reused_with_fresh_state():
    s = Sampler(VOCAB)
    a = s.add(SamplingParams(temperature=0, frequency_penalty=2.0), [])
    s.sample(_logits(1), np.array([a]), np.zeros(1, np.int64))
    s.remove(a)
    b = s.add(SamplingParams(temperature=0, frequency_penalty=2.0), [])
    logits = _logits(1)
    assert s.sample(logits, np.array([b]), np.zeros(1, np.int64)).token_ids[0] == logits.argmax()
    assert s.num_active == 1


def test_mix_seed_is_stable():
    assert mix_seed(0, 0) != mix_seed(0, 1)
    assert mix_seed(42, 7) == mix_seed(42, 7) < 2**64


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_tokens=0),
        dict(temperature=-0.1),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_k=-2),
        dict(min_p=1.5),
        dict(n=0),
        dict(repetition_penalty=0),
        dict(presence_penalty=3),
        dict(stop=[""]),
        dict(stop_token_ids=[-1]),
        dict(logprobs=-1),
        dict(temperature=float("nan")),
        dict(seed="x"),
    ],
)
def test_sampling_params_validation(kwargs):
    with pytest.raises(InvalidArgumentError):
        SamplingParams(**kwargs)
