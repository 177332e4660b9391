"""The sampler's device-side noise (Philox4x32-10 on int64 lanes) and the sampler built on it."""
import collections
import math
import random

import pytest
import torch

from megainfer.engine import philox as S
from megainfer.engine.request import Request
from megainfer.engine.sampler import Sampler, filter_logits, mix_seed
from megainfer.engine.sampling_params import SamplingParams

M32 = 0xFFFFFFFF
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _req(params, seed=0, n_out=0):
    r = Request(0, "r", None, [1], params, seed=seed)
    r.output_token_ids = [0] * n_out
    return r


def _keys(n, seed=0):
    return torch.tensor([mix_seed(seed, i) for i in range(n)])


def _bits(keys, n):
    return S.random_bits(keys & M32, keys >> 32, n)


def _chi2(counts, probs):
    n = counts.sum()
    return float(((counts - n * probs) ** 2 / (n * probs)).sum())


# -- the generator ---------------------------------------------------------------------------

# Random123's kat_vectors for philox4x32 with 10 rounds: counter, key -> output
KAT = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
       ((M32,) * 4, (M32, M32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
       ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]


@pytest.mark.parametrize("ctr,key,want", KAT)
def test_philox_known_answers(ctr, key, want):
    assert S.philox4x32(*ctr, *key) == want  # Python ints: exact arithmetic
    got = S.philox4x32(*(torch.tensor([v]) for v in ctr + key))
    assert [int(w) for w in got] == list(want)


def test_int64_lanes_never_overflow():
    """The int64 tensor path equals exact Python-int arithmetic, extremes included."""
    rng = random.Random(0)
    vals = [0, 1, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, M32 - 1, M32]
    rows = [[rng.choice(vals) if rng.random() < 0.3 else rng.getrandbits(32) for _ in range(6)]
            for _ in range(300)]
    t = torch.tensor(rows).T
    got = torch.stack(S.philox4x32(*t), -1).tolist()
    assert got == [list(S.philox4x32(*row)) for row in rows]
    a = torch.tensor(vals)
    for m in (S._PHILOX_M[0], S._PHILOX_M[1], M32):
        hi, lo = S._mulhilo(a, m)
        assert [(h << 32) | l for h, l in zip(hi.tolist(), lo.tolist())] == [v * m for v in vals]


def test_bits_depend_on_key_and_position_only():
    keys = torch.cat([_keys(5, 1), torch.tensor([0, (1 << 63) - 1])])
    full = _bits(keys, 1003)
    assert full.min() >= 0 and full.max() <= M32
    assert torch.equal(_bits(keys, 37), full[:, :37])  # not on the vocab size
    assert torch.equal(_bits(keys[3:4], 1003), full[3:4])  # not on the other rows
    assert torch.equal(_bits(keys.flip(0), 1003), full.flip(0))


def test_uniform_statistics():
    u = S.uniform(_keys(10, 3), 10_000).flatten().double()  # 1e5 draws
    n = u.numel()
    assert u.dtype == torch.float64 and (u > 0).all() and (u < 1).all()
    assert abs(u.mean() - 0.5) < 0.004 and abs(u.var() - 1 / 12) < 0.002
    counts = torch.histc(u, bins=100, min=0, max=1)
    assert _chi2(counts, torch.full((100,), 0.01, dtype=torch.float64)) < 160  # df 99, p ~ 1e-4
    ks = (torch.arange(1, n + 1, dtype=torch.float64) / n - u.sort().values).abs().max()
    assert ks < 1.95 / math.sqrt(n)  # p ~ 0.001
    bits = _bits(_keys(10, 3), 10_000)
    freq = torch.stack([((bits >> b) & 1).double().mean() for b in range(32)])
    assert ((freq - 0.5).abs() < 0.008).all()  # 5 sigma
    e = -torch.log1p(-u)
    assert torch.isfinite(e).all() and (e > 0).all() and abs(e.mean() - 1) < 0.02


def test_uniform_uncorrelated():
    k = mix_seed(9, 4)
    keys = torch.tensor([k, k ^ 1, k ^ 2, k ^ (1 << 32), k ^ (1 << 62), mix_seed(9, 5),
                         mix_seed(10, 4)])
    u = S.uniform(keys, 20_000).double()
    lim = 5 / math.sqrt(u.shape[1])
    c = torch.corrcoef(u)
    assert (c - torch.eye(len(keys), dtype=torch.float64)).abs().max() < lim
    for lag in (1, 2, 3, 4, 5):  # across Philox words and counters
        c = torch.corrcoef(torch.stack([u[0, :-lag], u[0, lag:]]))[0, 1]
        assert abs(c) < lim, lag


def test_uniform_bottom_cell_is_fine_grained():
    x = torch.tensor([0, 1, 0xFF, 0x100, 0xFFFFFFFF])
    u = S.bits_to_uniform(x)
    assert u.tolist() == [0.5 * 2 ** -32, 1.5 * 2 ** -32, 255.5 * 2 ** -32, 2 ** -24, 1 - 2 ** -24]
    e = S.exponential(torch.tensor([0]), torch.tensor([0]), 10)
    assert torch.isfinite(e).all() and (e > 0).all()


# -- the sampler -------------------------------------------------------------------------------

LOGITS8 = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.5, 1.2, 0.7])


def _draws(params, n=4000, seed=3, logits=LOGITS8):
    """n samples of one request at output indices 0..n-1 (rows are independent, so in one call)."""
    return Sampler()(logits.expand(n, -1), [_req(params, seed, i) for i in range(n)])


def test_distribution_matches_softmax():
    for temp in (0.7, 1.0, 1.8):
        toks = _draws(SamplingParams(temperature=temp))
        counts = torch.bincount(torch.tensor(toks), minlength=8).double()
        probs = (LOGITS8.double() / temp).softmax(-1)
        assert _chi2(counts, probs) < 30, temp  # df 7, p ~ 1e-4


def _allowed(row, k, p, mp):
    probs = row.double().softmax(-1)
    order = probs.argsort(descending=True).tolist()
    keep = [i for i in order[:k] if probs[i] >= mp * probs[order[0]]]
    mass = probs[keep].sum()
    out, acc = [], 0.0
    for i in keep:
        if acc >= p * mass and out:
            break
        out.append(i)
        acc += float(probs[i])
    return out


@pytest.mark.parametrize("k,p,mp", [(3, 1.0, 0.0), (-1, 0.6, 0.0), (-1, 1.0, 0.3), (4, 0.8, 0.1),
                                    (1, 1.0, 0.0)])
def test_filters_emit_allowed_tokens_with_renormalised_probs(k, p, mp):
    toks = _draws(SamplingParams(temperature=1.0, top_k=k, top_p=p, min_p=mp), n=3000)
    allowed = _allowed(LOGITS8, 8 if k == -1 else k, p, mp)
    assert set(toks) <= set(allowed)
    if len(allowed) > 1:
        counts = torch.bincount(torch.tensor(toks), minlength=8).double()[allowed]
        probs = LOGITS8.double()[allowed].softmax(-1)
        assert _chi2(counts, probs) < 30


def test_batch_independence():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 64, generator=g) * 2
    mine = SamplingParams(temperature=0.9)
    others = [SamplingParams(temperature=0), SamplingParams(temperature=1.3, top_k=5, top_p=0.8,
                                                            min_p=0.05),
              SamplingParams(temperature=0.5, top_p=0.5)]
    for n in range(40):
        alone = Sampler()(logits[:1], [_req(mine, 7, n)])[0]
        reqs = [_req(others[0], 1, 3), _req(others[1], 2, n), _req(mine, 7, n),
                _req(others[2], 7, 0)]
        batch = logits[[1, 2, 0, 3]]
        got = Sampler()(batch, reqs)
        assert got[2] == alone, n
        assert got[0] == batch[0].argmax()
        moved = [2, 3, 1, 0]
        assert Sampler()(batch[moved], [reqs[i] for i in moved])[0] == alone
        # a filtering row, alone and in the batch
        assert Sampler()(batch[1:2], reqs[1:2])[0] == got[1]


def test_determinism_and_seeds():
    logits = torch.zeros(1, 1000)
    run = lambda seed: [Sampler()(logits, [_req(SamplingParams(), seed, n)])[0] for n in range(30)]
    a = run(5)
    assert a == run(5)
    assert a != run(6)
    assert len(set(a)) > 20  # flat logits: the indices give different samples


def test_no_host_rng_and_one_copy_each_way(monkeypatch):
    """No torch.Generator or host random draws, one host->device table, one tolist, no item."""
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(1))
    reqs = [_req(SamplingParams(temperature=0.8), 1, 2), _req(SamplingParams(temperature=0), 2),
            _req(SamplingParams(top_k=3, top_p=0.9, min_p=0.1), 3, 9),
            _req(SamplingParams(temperature=1.5), 4), _req(SamplingParams(top_p=0.5), 5, 1)]
    want = Sampler()(logits, reqs)

    def banned(*a, **k):
        raise AssertionError("random numbers drawn on the host")
    for name in ("Generator", "rand", "rand_like", "randn", "randn_like", "randint", "randperm",
                 "multinomial", "bernoulli", "normal", "poisson"):
        monkeypatch.setattr(torch, name, banned)
    for name in ("uniform_", "exponential_", "random_", "normal_", "bernoulli_", "geometric_",
                 "cauchy_", "log_normal_"):
        monkeypatch.setattr(torch.Tensor, name, banned)
    calls = collections.Counter()

    def counted(owner, name):
        orig = getattr(owner, name)

        def f(*a, **k):
            calls[name] += 1
            return orig(*a, **k)
        monkeypatch.setattr(owner, name, f)
    for name in ("tensor", "as_tensor", "from_numpy"):
        counted(torch, name)
    for name in ("tolist", "item", "cpu", "numpy"):
        counted(torch.Tensor, name)
    assert Sampler()(logits, reqs) == want
    assert calls["tensor"] + calls["as_tensor"] + calls["from_numpy"] == 1, calls
    assert calls["tolist"] == 1 and calls["item"] + calls["cpu"] + calls["numpy"] == 0, calls


def test_filter_logits_row_with_filters_off_is_untouched():
    logits = torch.randn(3, 4000, generator=torch.Generator().manual_seed(2)) * 4
    got = filter_logits(logits, torch.tensor([4000, 5, 4000]), torch.tensor([1.0, 1.0, 0.3]),
                        torch.tensor([0.0, 0.0, 0.0]))
    assert torch.equal(got[0], logits[0])
    assert torch.isfinite(got[1]).sum() == 5 and torch.isfinite(got[2]).sum() >= 1


# -- CUDA ----------------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_cuda
def test_bits_cpu_equal_cuda():
    keys = torch.cat([_keys(64, 5), torch.tensor([0, 1, (1 << 63) - 1])])
    cpu = _bits(keys, 1001)
    dev = _bits(keys.cuda(), 1001)
    assert torch.equal(cpu, dev.cpu())
    assert torch.equal(S.bits_to_uniform(cpu), S.bits_to_uniform(dev).cpu())


@pytest.mark.gpu
@needs_cuda
def test_sampler_on_cuda_is_sync_free():
    logits = torch.randn(6, 3000, generator=torch.Generator().manual_seed(3)) * 3
    reqs = [_req(SamplingParams(temperature=0.8), 1, 2), _req(SamplingParams(temperature=0), 2),
            _req(SamplingParams(top_k=3, top_p=0.9, min_p=0.1), 3, 9),
            _req(SamplingParams(temperature=1.5), 4), _req(SamplingParams(top_p=0.5), 5, 1),
            _req(SamplingParams(temperature=0.3), 6, 4)]
    dev = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = Sampler().sample(dev, reqs)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert out.device.type == "cuda"
    # same noise bits; float rounding could only flip an exact near-tie
    assert out.tolist() == Sampler()(logits, reqs)


def test_logprobs_are_raw_when_rows_are_selected_and_masked():
    """Logprobs come from the raw logits even when the sampled rows are a selection (``rows``)
    and a min_tokens mask is written afterwards: the mask must not reach the logprob rows."""
    torch.manual_seed(0)
    logits = torch.randn(3, 8)
    p = SamplingParams(temperature=0.0, logprobs=2, min_tokens=4, stop_token_ids=[5])
    reqs = [_req(p), _req(p)]
    out = Sampler().run(logits, reqs, rows=[2, 0])
    for req_row, i in ((2, 0), (0, 1)):
        want = logits[req_row].log_softmax(-1)
        lp, rank, ids, lps = out.logprobs[i]
        assert ids == want.topk(2).indices.tolist()
        assert lps == pytest.approx(want.topk(2).values.tolist(), abs=1e-6)
        assert lp == pytest.approx(want[out.tokens[i]].item(), abs=1e-6)
        assert out.tokens[i] != 5  # the mask still applies to sampling


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logit_bias_adds_to_the_logits_before_sampling(temperature):
    """``logit_bias`` against its torch reference (the biased logits through the same sampler):
    greedy and seeded rows alike, with a penalty after it and rows without a bias untouched;
    the logprobs stay raw; +100 forces a token, -100 bans the argmax."""
    torch.manual_seed(1)
    logits = torch.randn(4, 32)
    bias = {3: 2.5, 7: -1.0, 30: 4.0}
    kw = dict(temperature=temperature, seed=11, presence_penalty=0.5, logprobs=1)
    biased = [_req(SamplingParams(**kw, logit_bias=bias), seed=i, n_out=2) for i in range(2)]
    plain = [_req(SamplingParams(**kw), seed=i + 2, n_out=2) for i in range(2)]
    out = Sampler().run(logits, biased + plain)
    ref = logits.clone()
    for t, b in bias.items():
        ref[:2, t] += b
    want = Sampler().run(ref, [_req(SamplingParams(**kw), seed=i, n_out=2) for i in range(2)]
                         + [_req(SamplingParams(**kw), seed=i + 2, n_out=2) for i in range(2)])
    assert out.tokens == want.tokens
    for i in range(4):
        assert out.logprobs[i][2] == logits[i].log_softmax(-1).topk(1).indices.tolist()
    force = _req(SamplingParams(temperature=0.0, logit_bias={9: 100}))
    top = int(logits[0].argmax())
    ban = _req(SamplingParams(temperature=0.0, logit_bias={top: -100}))
    got = Sampler()(logits[:2], [force, ban])
    assert got[0] == 9 and got[1] != top


@pytest.mark.parametrize("bias", [{1: 101}, {-1: 1.0}, {"3": 1.0}, {2: float("nan")}, [1, 2]])
def test_bad_logit_bias_is_named(bias):
    from megainfer.engine.errors import SamplingParamsError
    with pytest.raises(SamplingParamsError, match="logit_bias"):
        SamplingParams(logit_bias=bias)
