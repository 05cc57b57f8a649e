"""Expert-parallel MoE dispatch/combine vs a NumPy model of the routing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_triton_dist as jtd


def run_layer(ranks, tokens, expert_ids, weights, num_experts, capacity=None, platform="cpu"):
    """dispatch -> expert e multiplies its rows by (e + 1) -> combine, per rank."""
    mesh = Mesh(np.array(jax.devices(platform)[:ranks]), ("x",))
    local = num_experts // ranks

    def layer(x, ids, w):
        inputs, routing = jtd.moe_dispatch(x, ids, "x", num_experts=num_experts,
                                           capacity=capacity)
        scale = (jax.lax.axis_index("x") * local + jnp.arange(local) + 1).astype(x.dtype)
        out = jtd.moe_combine(inputs * scale[:, None, None], routing, w, "x")
        return inputs, out, routing.dropped[None], routing.recv_counts

    f = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=(P("x"),) * 3,
                              out_specs=(P("x"),) * 4))
    args = [jax.device_put(a, NamedSharding(mesh, P("x"))) for a in (tokens, expert_ids, weights)]
    return [np.asarray(a) for a in f(*args)]


def model(ranks, tokens, expert_ids, weights, num_experts, capacity):
    """What dispatch and combine must produce."""
    t = tokens.shape[0] // ranks
    k = expert_ids.shape[1]
    local = num_experts // ranks
    inputs = np.zeros((ranks * local, capacity, tokens.shape[1]), np.float32)
    fill = np.zeros(num_experts, int)
    kept = np.zeros(expert_ids.shape, bool)
    for src in range(ranks):  # sources in rank order, entries in routing order
        for i in range(t * k):
            token, choice = src * t + i // k, i % k
            e = expert_ids[token, choice]
            if fill[e] < capacity:
                inputs[e, fill[e]] = tokens[token]
                kept[token, choice] = True
            fill[e] += 1
    scale = np.arange(1, num_experts + 1, dtype=np.float32)[expert_ids]
    out = (weights * scale * kept)[:, :, None] * tokens[:, None, :]
    dropped = (~kept).reshape(ranks, t * k).sum(1)
    return inputs, out.sum(1), dropped


def routing(ranks, t, k, num_experts, skew, seed):
    rng = np.random.default_rng(seed)
    if skew:  # most choices go to expert 0; the last experts get nothing
        probs = np.full(num_experts, 0.2 / max(num_experts - 3, 1))
        probs[0], probs[-2:] = 0.8, 0.0
        probs /= probs.sum()
    else:
        probs = np.full(num_experts, 1.0 / num_experts)
    ids = np.stack([rng.choice(num_experts, size=k, replace=False, p=probs)
                    for _ in range(ranks * t)]).astype(np.int32)
    tokens = rng.standard_normal((ranks * t, 24)).astype(np.float32)
    weights = rng.random((ranks * t, k)).astype(np.float32)
    return tokens, ids, weights


@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("skew", [False, True])
def test_dispatch_and_combine(ranks, k, skew):
    num_experts, t = 2 * ranks if ranks > 1 else 4, 10
    tokens, ids, weights = routing(ranks, t, k, num_experts, skew, seed=ranks * 10 + k)
    capacity = ranks * t * k
    inputs, out, dropped, _ = run_layer(ranks, tokens, ids, weights, num_experts)
    want_inputs, want_out, want_dropped = model(ranks, tokens, ids, weights, num_experts,
                                                capacity)
    np.testing.assert_array_equal(inputs, want_inputs)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(dropped, want_dropped)
    assert not dropped.any()


def test_overflow_is_dropped_and_reported():
    ranks, t, k, num_experts, capacity = 4, 12, 2, 8, 5
    tokens, ids, weights = routing(ranks, t, k, num_experts, skew=True, seed=7)
    inputs, out, dropped, counts = run_layer(ranks, tokens, ids, weights, num_experts,
                                             capacity=capacity)
    want_inputs, want_out, want_dropped = model(ranks, tokens, ids, weights, num_experts,
                                                capacity)
    np.testing.assert_array_equal(inputs, want_inputs)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(dropped, want_dropped)
    assert dropped.sum() > 0  # the skew overflows expert 0: reported, not silent
    assert counts.reshape(ranks, ranks, -1).sum(1).reshape(-1)[0] > capacity


def test_repeated_calls_with_fresh_routing():
    ranks, t, k, num_experts = 4, 6, 2, 8
    for seed in range(4):  # staging slots alternate
        tokens, ids, weights = routing(ranks, t, k, num_experts, skew=seed % 2 == 1, seed=seed)
        _, out, _, _ = run_layer(ranks, tokens, ids, weights, num_experts)
        _, want_out, _ = model(ranks, tokens, ids, weights, num_experts, ranks * t * k)
        np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)


def test_moe_errors():
    mesh = Mesh(np.array(jax.devices("cpu")[:4]), ("x",))

    def trace(fn, *args):
        f = jax.shard_map(fn, mesh=mesh, in_specs=(P("x"),) * len(args), out_specs=P("x"))
        return jax.jit(f).lower(*args)

    x, ids = jnp.ones((16, 8)), jnp.zeros((16, 2), jnp.int32)
    with pytest.raises(ValueError, match="num_experts=6 does not divide by the 4 ranks"):
        trace(lambda a, b: jtd.moe_dispatch(a, b, "x", num_experts=6)[0], x, ids)
    with pytest.raises(TypeError, match="expert_ids must be integers"):
        trace(lambda a, b: jtd.moe_dispatch(a, b, "x", num_experts=8)[0], x, ids * 1.0)
    with pytest.raises(ValueError, match="capacity must be positive"):
        trace(lambda a, b: jtd.moe_dispatch(a, b, "x", num_experts=8, capacity=0)[0], x, ids)
