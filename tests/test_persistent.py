"""Persistent variants of the fused GEMM + communication kernels (fewer programs than
tiles, each looping over tiles; all programs resident at once), loading tiles through
pointers or tensor descriptors (TMA): on CPU every program of a co-resident launch runs on
a thread of its own, so programs that wait on each other make progress as they do on a
GPU. Checked against jnp.dot in float32 composed with jax.lax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import triton
import triton.language as tl
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_triton_dist as jtd
import jax_triton_dist.language as dl
from jax_triton_dist import tiles
from jax_triton_dist.kernels.tile_exchange import tile_owner


@pytest.fixture(params=[pytest.param((False, False), id="pointers"),
                        pytest.param((True, False), id="tma"),
                        pytest.param((False, True), id="stream-k-pointers",
                                     marks=pytest.mark.slow),
                        pytest.param((True, True), id="stream-k-tma")])
def persistent(monkeypatch, request):
    """The fused ops' only config: persistent, 3 programs per rank, small tiles; loading
    through pointers, or through tensor descriptors where the op allows them; whole tiles,
    or (stream-K) the tiles of the partial last wave shared out by K blocks first."""
    tma_form, stream_k = request.param

    def configs(m, n, k, copies=1, target="cuda", tma=False, **_):
        use_tma = tma_form and tma and k % 16 == 0 and n % 16 == 0
        return [{"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4,
                 "num_stages": 3, "PERSISTENT": True, "USE_TMA": use_tma,
                 "STREAM_K": stream_k}]

    monkeypatch.setattr(tiles, "gemm_configs", configs)
    monkeypatch.setattr(tiles, "fill_programs", lambda target="cuda": 3)


def mesh_1d(ranks):
    return Mesh(np.array(jax.devices("cpu")[:ranks]), ("x",))


def put(mesh, x, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def rand(shape, seed, dtype=jnp.float32, scale=1.0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, dtype)


def dot32(a, b):
    return jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)


def assert_close(out, ref, dtype):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < tol


@pytest.mark.parametrize("ranks, dtype", [(1, jnp.float32), (2, jnp.float32),
                                         pytest.param(4, jnp.float32, marks=pytest.mark.slow),
                                         (2, jnp.bfloat16)])
def test_all_gather_matmul(persistent, ranks, dtype):
    mesh = mesh_1d(ranks)
    x, w = rand((ranks * 24, 48), ranks, dtype), rand((48, 64), 7, dtype, 0.2)
    f = jax.jit(jax.shard_map(lambda a, b: jtd.all_gather_matmul(a, b, "x"), mesh=mesh,
                              in_specs=(P("x"), P()), out_specs=P("x")))
    for _ in range(3):  # back to back: the flags of one call must not satisfy the next
        out = f(put(mesh, x, P("x")), put(mesh, w, P()))
    for block in np.asarray(out, np.float32).reshape(ranks, ranks * 24, 64):  # every rank
        assert_close(block, dot32(x, w), dtype)


@pytest.mark.parametrize("persistent_form, stream_k", [
    (True, False), (False, False), pytest.param(True, True, marks=pytest.mark.slow)],
    ids=["persistent", "grid", "stream-k"])
@pytest.mark.parametrize("ranks, dtype", [(2, jnp.float32), (3, jnp.bfloat16)])
def test_all_gather_matmul_stores_through_a_descriptor(monkeypatch, persistent_form, stream_k,
                                                       ranks, dtype):
    """AG+GEMM's ``TMA_STORE`` form (output tiles through one ``[ranks, m, N]``
    descriptor): 24 rows per shard in 16-row tiles, so each shard's last tile is clipped
    at the shard's end (a 2-D descriptor of the whole output would spill its zero rows
    into the next shard); with a bias and an activation; every rank's result."""
    config = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4,
              "num_stages": 3, "PERSISTENT": persistent_form, "USE_TMA": True,
              "STREAM_K": stream_k, "TMA_STORE": True}
    seen = []

    def configs(m, n, k, copies=1, target="cuda", tma=False, tma_store=False, **_):
        seen.append(tma_store)
        return [config]

    monkeypatch.setattr(tiles, "gemm_configs", configs)
    monkeypatch.setattr(tiles, "fill_programs", lambda target="cuda": 3)
    mesh = mesh_1d(ranks)
    x, w = rand((ranks * 24, 48), ranks, dtype), rand((48, 64), 7, dtype, 0.2)
    bias = rand((64,), 9, dtype)
    f = jax.jit(jax.shard_map(
        lambda a, b, c: jtd.all_gather_matmul(a, b, "x", bias=c, activation="relu"),
        mesh=mesh, in_specs=(P("x"), P(), P()), out_specs=P("x")))
    for _ in range(2):
        out = f(put(mesh, x, P("x")), put(mesh, w, P()), put(mesh, bias, P()))
    assert seen and all(seen)  # the op asked for the TMA_STORE forms
    want = jax.nn.relu(dot32(x, w) + bias.astype(jnp.float32))
    for block in np.asarray(out, np.float32).reshape(ranks, ranks * 24, 64):
        assert_close(block, want, dtype)


def _one_config(monkeypatch, config, asked=None):
    """Makes ``config`` the fused ops' only one (3 programs fill the device); records in
    ``asked`` the keyword arguments each op asked ``gemm_configs`` for."""
    def configs(m, n, k, copies=1, target="cuda", **kwargs):
        if asked is not None:
            asked.append(kwargs)
        return [config]

    monkeypatch.setattr(tiles, "gemm_configs", configs)
    monkeypatch.setattr(tiles, "fill_programs", lambda target="cuda": 3)


def _all_reduce_exchange(monkeypatch, two_shot):
    """Makes GEMM+AR's exchange (a form its op puts on every config) the one-shot or the
    two-shot one."""
    from jax_triton_dist.fused import launch

    monkeypatch.setattr(launch, "ALL_REDUCE_FORMS", ({"TWO_SHOT": two_shot},))


@pytest.mark.parametrize("store", [{}, {"TMA_STORE": True},
                                   {"TMA_STORE": True, "SUBTILE": True, "BLOCK_N": 32}],
                         ids=["stores", "tma-store", "tma-halves"])
@pytest.mark.parametrize("ranks, dtype", [(1, jnp.float32), (2, jnp.bfloat16),
                                         (3, jnp.float32)])
def test_all_gather_matmul_flattened(monkeypatch, store, ranks, dtype):
    """AG+GEMM's ``FLATTEN`` form (each shard's tile loop pipelined with its K loop, the
    shard's wait before it): 3 programs over each shard's tiles, so each program starts
    each shard at a different tile; 40 rows a shard in 16-row tiles (clipped last tiles);
    48 columns (``SUBTILE``: 32-column tiles stored in halves, the last tile's second half
    wholly past the edge); with a bias and an activation; every rank's result."""
    asked = []
    _one_config(monkeypatch, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2,
                              "num_warps": 4, "num_stages": 3, "PERSISTENT": True,
                              "USE_TMA": True, "FLATTEN": True, **store}, asked)
    mesh = mesh_1d(ranks)
    x, w = rand((ranks * 40, 48), ranks + 30, dtype), rand((48, 48), 8, dtype, 0.2)
    bias = rand((48,), 10, dtype)
    f = jax.jit(jax.shard_map(
        lambda a, b, c: jtd.all_gather_matmul(a, b, "x", bias=c, activation="silu"),
        mesh=mesh, in_specs=(P("x"), P(), P()), out_specs=P("x")))
    for _ in range(2):
        out = f(put(mesh, x, P("x")), put(mesh, w, P()), put(mesh, bias, P()))
    assert asked and all(a.get("flatten") for a in asked)  # the op asked for FLATTEN forms
    want = jax.nn.silu(dot32(x, w) + bias.astype(jnp.float32))
    for block in np.asarray(out, np.float32).reshape(ranks, ranks * 40, 48):
        assert_close(block, want, dtype)


# the stores of one rank's tiles: per thread, through C's descriptor, in halves (32-column
# tiles over 48 columns: the last tile's second half wholly past the edge)
ONE_RANK_STORES = pytest.mark.parametrize(
    "store", [{}, {"TMA_STORE": True}, {"TMA_STORE": True, "SUBTILE": True, "BLOCK_N": 32}],
    ids=["stores", "tma-store", "tma-halves"])


@ONE_RANK_STORES
@pytest.mark.parametrize("ranks, dtype, persistent", [
    (1, jnp.float32, True), (1, jnp.bfloat16, False), (2, jnp.bfloat16, True),
    (3, jnp.float32, True)])
def test_matmul_reduce_scatter_flattened(monkeypatch, store, ranks, dtype, persistent):
    """GEMM+RS's ``FLATTEN`` form (the peers' segments in pipelined loops that only push,
    the own segment last, its flags all acquired before its pipelined loop; one rank's
    tiles a loop of stores, which ``TMA_STORE`` and ``SUBTILE`` store through C's
    descriptor, and change nothing at more ranks): 3 programs over each segment's tiles
    (40 rows in 16-row tiles, clipped); with a bias and an activation; back to back;
    every rank's segment. Without ``PERSISTENT`` (one tile a program) one rank's tiles
    are stored the same ways."""
    asked = []
    _one_config(monkeypatch, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2,
                              "num_warps": 4, "num_stages": 3, "PERSISTENT": persistent,
                              "USE_TMA": True, "FLATTEN": persistent, **store}, asked)
    mesh = mesh_1d(ranks)
    x, w = rand((ranks * 40, ranks * 16), ranks + 50, dtype), rand((ranks * 16, 48), 51, dtype,
                                                                    0.2)
    bias = rand((48,), 52, dtype)
    f = jax.jit(jax.shard_map(
        lambda a, b, c: jtd.matmul_reduce_scatter(a, b, "x", bias=c, activation="gelu"),
        mesh=mesh, in_specs=(P(None, "x"), P("x", None), P()), out_specs=P("x")))
    for _ in range(3):
        out = f(put(mesh, x, P(None, "x")), put(mesh, w, P("x", None)), put(mesh, bias, P()))
    assert asked and all(a.get("flatten") and a.get("tma_store") == (ranks == 1)
                         for a in asked)
    want = jax.nn.gelu(dot32(x, w) + bias.astype(jnp.float32), approximate=False)
    assert_close(out, want, dtype)


@pytest.mark.parametrize("ranks, rows, programs, flatten", [
    (3, 20, 4, False), (3, 20, 4, True), (4, 16, 5, True), (2, 20, 7, False),
    pytest.param(8, 20, 5, True, marks=pytest.mark.slow)])
def test_matmul_reduce_scatter_program_flags(monkeypatch, ranks, rows, programs, flatten):
    """Persistent GEMM+RS raises one flag per program and peer after the program's last
    push (``kernels/gemm_collectives.py``'s ``_notify_owners``), and the owner of a tile
    finds the pushing program's flag from the tile's position: right however the grid
    meets the tiles — programs that do not divide a segment's tiles (6 tiles, 4 or 5
    programs: a program's tiles of one segment start at different positions in the next),
    more programs than a segment has tiles (16 rows: 3 tiles, 5 programs; 6 tiles, 7
    programs: some programs push nothing to some peers), up to 8 ranks; flattened or not;
    back to back (flags of the epoch before must not pass for this one's)."""
    config = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4,
              "num_stages": 3, "PERSISTENT": True, "USE_TMA": flatten, "FLATTEN": flatten}
    _one_config(monkeypatch, config)
    monkeypatch.setattr(tiles, "fill_programs", lambda target="cuda": programs)
    mesh = mesh_1d(ranks)
    w = rand((ranks * 16, 48), 61, jnp.float32, 0.2)
    f = jax.jit(jax.shard_map(lambda a, b: jtd.matmul_reduce_scatter(a, b, "x"), mesh=mesh,
                              in_specs=(P(None, "x"), P("x")), out_specs=P("x")))
    for call in range(3):
        x = rand((ranks * rows, ranks * 16), 60 + call)
        out = f(put(mesh, x, P(None, "x")), put(mesh, w, P("x")))
        assert_close(out, dot32(x, w), jnp.float32)


@triton.jit
def _owners_kernel(out_ptr, programs, num_tiles, world, BLOCK: tl.constexpr):
    tile = tl.arange(0, BLOCK)
    tl.store(out_ptr + tile, tile_owner(tile, programs, num_tiles, world), mask=tile < num_tiles)


def _owners(programs, num_tiles, world):
    from jax_triton_dist.runtime import interpreter

    out = np.full(num_tiles, -1, np.int32)
    interpreter.launch(_owners_kernel, (1,), [interpreter.Pointer(out.ctypes.data, "int32"),
                                              programs, num_tiles, world], {"BLOCK": 256})
    return out


@pytest.mark.parametrize("programs, world, num_tiles", [(16, 8, 128), (66, 2, 128),
                                                        (33, 4, 128), (4, 3, 9), (5, 8, 9),
                                                        (9, 2, 9), (3, 8, 4)])
def test_two_shot_owners_spread_each_programs_tiles(programs, world, num_tiles):
    """Two-shot GEMM+AR's tile owners (``tile_exchange.tile_owner``): each program's tiles
    go to the ranks in turn, and over the grid every rank owns as many tiles as any other,
    give or take one — with ``tile % world`` the overlap proxy's grids (16 programs a rank
    at 8 ranks, 66 at 2; 128 tiles) gave each program one owner for all its tiles, so a
    few programs did every sum; with one program a tile the owner is ``tile % world``."""
    owners = _owners(programs, num_tiles, world)
    assert owners.min() >= 0 and owners.max() < world
    for p in range(programs):
        counts = np.bincount(owners[p::programs], minlength=world)
        assert counts.max() - counts.min() <= 1, (p, counts)
    totals = np.bincount(owners, minlength=world)
    assert totals.max() - totals.min() <= 1, totals
    assert list(_owners(num_tiles, num_tiles, world)) == [t % world for t in range(num_tiles)]


@pytest.mark.parametrize("two_shot", [False, True], ids=["one-shot", "two-shot"])
@pytest.mark.parametrize("ranks, programs, use_tma", [
    (3, 4, False), (3, 4, True), (4, 9, True), (2, 2, False),
    pytest.param(8, 5, True, marks=pytest.mark.slow)])
def test_matmul_all_reduce_program_flags(monkeypatch, ranks, programs, use_tma, two_shot):
    """Persistent GEMM+AR sends all of a program's partials, raises one flag per peer,
    then sums (two-shot: the tiles this rank owns, the sums sent to every peer under one
    more flag per peer, then the owners' sums copied) (``kernels/gemm_allreduce.py``'s
    ``_program_tiles``): right with programs that do not divide the 9 tiles (4, 5, 2: a
    program sums 2 to 5 tiles under one flag per peer, of owners that differ from tile to
    tile) or as many as the tiles, up to 8 ranks; back to back."""
    config = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4,
              "num_stages": 3, "PERSISTENT": True, "USE_TMA": use_tma}
    _one_config(monkeypatch, config)
    _all_reduce_exchange(monkeypatch, two_shot)
    monkeypatch.setattr(tiles, "fill_programs", lambda target="cuda": programs)
    mesh = mesh_1d(ranks)
    w = rand((ranks * 16, 48), 71, jnp.float32, 0.2)
    f = jax.jit(jax.shard_map(lambda a, b: jtd.matmul_all_reduce(a, b, "x"), mesh=mesh,
                              in_specs=(P(None, "x"), P("x")), out_specs=P(None)))
    for call in range(3):
        x = rand((40, ranks * 16), 70 + call)
        out = f(put(mesh, x, P(None, "x")), put(mesh, w, P("x")))
        assert_close(out, dot32(x, w), jnp.float32)


@ONE_RANK_STORES
@pytest.mark.parametrize("ranks, dtype, exchange, persistent", [
    (1, jnp.float32, False, True), (1, jnp.bfloat16, False, True),
    (1, jnp.float32, False, False), (2, jnp.float32, False, True),
    (3, jnp.bfloat16, True, True)])
def test_matmul_all_reduce_one_rank_forms(monkeypatch, store, ranks, dtype, exchange,
                                          persistent):
    """GEMM+AR at one rank: a single loop of stores (3 programs over 12 or 6 tiles, 40
    rows in 16-row tiles, clipped; without ``PERSISTENT`` one tile a program),
    ``FLATTEN`` pipelining it, ``TMA_STORE`` / ``SUBTILE`` storing through C's descriptor;
    forms the op asks for only there; at more ranks they change nothing (both exchanges);
    back to back."""
    asked = []
    _one_config(monkeypatch, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2,
                              "num_warps": 4, "num_stages": 3, "PERSISTENT": persistent,
                              "USE_TMA": True, "FLATTEN": persistent, **store}, asked)
    _all_reduce_exchange(monkeypatch, exchange)
    mesh = mesh_1d(ranks)
    x = rand((40, ranks * 32), ranks + 60, dtype)
    w = rand((ranks * 32, 48), 61, dtype, 0.2)
    f = jax.jit(jax.shard_map(lambda a, b: jtd.matmul_all_reduce(a, b, "x"), mesh=mesh,
                              in_specs=(P(None, "x"), P("x", None)), out_specs=P()))
    for _ in range(3):
        out = f(put(mesh, x, P(None, "x")), put(mesh, w, P("x", None)))
    assert asked and all(a.get("flatten") == a.get("tma_store") == (ranks == 1)
                         for a in asked)
    assert_close(out, dot32(x, w), dtype)


@pytest.mark.parametrize("form", [{}, {"USE_TMA": True, "FLATTEN": True}],
                         ids=["pointers", "tma-flattened"])
def test_all_gather_matmul_waits_once_per_peer_shard(monkeypatch, form):
    """A persistent AG+GEMM program acquires each peer shard's flag once, however many of
    the shard's tiles it computes (read from the timeline: 4 ranks, 3 programs, 8 tiles a
    shard, so a program computes 2 or 3 tiles of each shard)."""
    _one_config(monkeypatch, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2,
                              "num_warps": 4, "num_stages": 3, "PERSISTENT": True,
                              "USE_TMA": False, **form})
    ranks, programs, shard_tiles = 4, 3, 8
    mesh = mesh_1d(ranks)
    x, w = rand((ranks * 32, 32), 40), rand((32, 64), 41, scale=0.2)
    f = jax.jit(jax.shard_map(lambda a, b: jtd.all_gather_matmul(a, b, "x"), mesh=mesh,
                              in_specs=(P("x"), P()), out_specs=P("x")))
    with jtd.timeline.record() as rec:
        out = f(put(mesh, x, P("x")), put(mesh, w, P()))
        out.block_until_ready()
    for block in np.asarray(out).reshape(ranks, ranks * 32, 64):
        assert_close(block, dot32(x, w), jnp.float32)
    waits = {}
    for e in rec.events:
        if e["kind"] == "WAIT_START":
            waits[e["rank"], e["program"]] = waits.get((e["rank"], e["program"]), 0) + 1
    for rank in range(ranks):
        for program in range(programs):
            tiles = range(program, ranks * shard_tiles, programs)
            peers = {t // shard_tiles for t in tiles} - {0}  # shard steps past its own
            assert waits.get((rank, program), 0) == len(peers), (rank, program)


@pytest.mark.parametrize("ranks, dtype", [(1, jnp.float32), (2, jnp.float32),
                                         pytest.param(4, jnp.float32, marks=pytest.mark.slow),
                                         (2, jnp.bfloat16)])
def test_matmul_reduce_scatter(persistent, ranks, dtype):
    mesh = mesh_1d(ranks)
    x, w = rand((ranks * 20, ranks * 16), ranks, dtype), rand((ranks * 16, 48), 5, dtype, 0.2)
    f = jax.jit(jax.shard_map(lambda a, b: jtd.matmul_reduce_scatter(a, b, "x"), mesh=mesh,
                              in_specs=(P(None, "x"), P("x")), out_specs=P("x")))
    for _ in range(3):
        out = f(put(mesh, x, P(None, "x")), put(mesh, w, P("x")))
    assert_close(out, dot32(x, w), dtype)


@pytest.mark.parametrize("ranks", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_matmul_all_reduce(persistent, ranks):
    mesh = mesh_1d(ranks)
    x, w = rand((40, ranks * 16), ranks), rand((ranks * 16, 48), 3, scale=0.2)
    f = jax.jit(jax.shard_map(lambda a, b: jtd.matmul_all_reduce(a, b, "x"), mesh=mesh,
                              in_specs=(P(None, "x"), P("x")), out_specs=P(None)))
    for _ in range(3):
        out = f(put(mesh, x, P(None, "x")), put(mesh, w, P("x")))
    assert_close(out, dot32(x, w), jnp.float32)


@pytest.mark.parametrize("ranks, dtype", [(1, jnp.float32), (2, jnp.float32),
                                         pytest.param(2, jnp.bfloat16, marks=pytest.mark.slow)])
def test_weights_stored_nk(persistent, ranks, dtype):
    """``[N, K]`` weights (``w_layout="nk"``): read through their own descriptors
    (``[BLOCK_N, BLOCK_K]`` blocks transposed for the product) or pointers, in all three
    ops; every rank's result against the float32 product with the transposed weight."""
    mesh = mesh_1d(ranks)
    x, w_nk = rand((ranks * 32, ranks * 32), ranks + 11, dtype), rand((48, ranks * 32), 13,
                                                                      dtype, 0.2)
    ref = dot32(x, w_nk.T)
    ops = {  # op, in_specs, out_spec, the reference as out_spec lays it out
        "ag": (lambda a, b: jtd.all_gather_matmul(a, b, "x", w_layout="nk"),
               (P("x"), P()), P("x"), np.tile(np.asarray(ref), (ranks, 1))),
        "rs": (lambda a, b: jtd.matmul_reduce_scatter(a, b, "x", w_layout="nk"),
               (P(None, "x"), P(None, "x")), P("x"), ref),
        "ar": (lambda a, b: jtd.matmul_all_reduce(a, b, "x", w_layout="nk"),
               (P(None, "x"), P(None, "x")), P(None), ref),
    }
    for op, in_specs, out_spec, want in ops.values():
        f = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=in_specs, out_specs=out_spec))
        for _ in range(2):
            out = f(put(mesh, x, in_specs[0]), put(mesh, w_nk, in_specs[1]))
        assert_close(out, want, dtype)


def test_programs_that_wait_on_each_other_need_co_resident():
    """A kernel whose program 0 waits for program 1 of the same launch: it completes only
    when its programs run at once (co_resident=True)."""
    @triton.jit
    def handshake_kernel(out_ptr, flags_ptr):
        pid = tl.program_id(0)
        epoch = dl.epoch()
        if pid == 1:
            dl.notify(flags_ptr, dl.rank(), epoch, "set", "sys")
        else:
            dl.wait(flags_ptr, 1, "sys", "acquire", epoch)
        tl.store(out_ptr + pid, pid + 1)

    mesh = mesh_1d(2)
    f = jax.jit(jax.shard_map(
        lambda x: jtd.triton_call(handshake_kernel, out_shape=jax.ShapeDtypeStruct((2,),
                                                                                   jnp.int32),
                                  workspace=[jtd.Workspace((1,), jnp.int32)], grid=(2,),
                                  axis_name="x", co_resident=True) + x,
        mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    out = f(jnp.zeros((4,), jnp.int32))
    np.testing.assert_array_equal(np.asarray(out), [1, 2, 1, 2])
