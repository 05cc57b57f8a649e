"""The Ascend lane's pure-Python parts on the CPU machine: the placeholder rewrites, the
semantic counts of IR text, the kernel catalog, the tile table and the command's
environment check. (The lowering itself runs in CI through scripts/ascend_check.sh, in the
triton-ascend environment.)"""

import ast
import inspect
import pathlib
import textwrap

import pytest

from jax_triton_dist import tiles
from jax_triton_dist.ascend import __main__ as ascend_cli
from jax_triton_dist.ascend import aclshmem_calls, catalog, checks, lowering
from jax_triton_dist.ascend.mlir_text import Lines
from jax_triton_dist.language.device_abi import ASCEND_TRAILING_ARGS

TTIR = textwrap.dedent("""\
    module {
      tt.func public @k(%arg0: !tt.ptr<i32> loc(#loc), %arg1: i32 loc(#loc)) attributes {noinline = false} {
        %c0_i32 = arith.constant 0 : i32 loc(#loc1)
        %0 = tt.extern_elementwise  {libname = "jtd_ascend", libpath = "", pure = true, symbol = "jtd_rank"} : () -> i32 loc(#loc2)
        %1 = arith.addi %0, %c0_i32 : i32 loc(#loc3)
        %2 = arith.cmpi eq, %1, %arg1 : i32
        scf.if %2 {
          %3 = tt.extern_elementwise  {libname = "jtd_ascend", libpath = "", pure = true, symbol = "jtd_epoch"} : () -> i32
          tt.store %arg0, %3 : !tt.ptr<i32>
        } else {
          %3 = arith.addi %0, %0 : i32
          tt.store %arg0, %3 : !tt.ptr<i32>
        }
        tt.return
      } loc(#loc)
    } loc(#loc)
""")


def test_context_placeholders_become_trailing_arguments_within_their_region():
    out = lowering.trailing_arguments(TTIR)
    signature = "".join(f", %jtd_{n}: {t}" for n, t in ASCEND_TRAILING_ARGS)
    assert f"%arg1: i32 loc(#loc){signature}) attributes" in out
    assert "extern_elementwise" not in out
    assert "%1 = arith.addi %jtd_rank, %c0_i32" in out
    assert "tt.store %arg0, %jtd_epoch : !tt.ptr<i32>" in out  # the then-branch's %3
    # the else branch reuses the name %3 for its own value: left alone
    assert "%3 = arith.addi %jtd_rank, %jtd_rank : i32" in out
    assert out.count("tt.store %arg0, %3 : !tt.ptr<i32>") == 1


def test_an_unknown_context_placeholder_is_an_error():
    bad = TTIR.replace('symbol = "jtd_rank"', 'symbol = "jtd_colour"')
    with pytest.raises(ValueError, match="unknown context placeholder jtd_colour"):
        lowering.trailing_arguments(bad)
    with pytest.raises(ValueError, match="no `tt.func public` kernel"):
        lowering.trailing_arguments("module {}")


LINALG = textwrap.dedent("""\
    module {
      func.func @k(%arg0: memref<?xi8>, %arg2: memref<?xi32>, %arg9: i32, %arg11: memref<?xi64>, %arg12: i32) {
        %c0_i32 = arith.constant 0 : i32
        %0 = tt.extern_elementwise %arg12 {libname = "jtd_ascend", libpath = "", pure = true, symbol = "jtd_acl_team_my_pe"} : (i32) -> i32
        %intptr = memref.extract_aligned_pointer_as_index %arg11 : memref<?xi64> -> index
        %6 = arith.index_cast %intptr : index to i64
        %7 = tt.extern_elementwise %6, %0 {libname = "jtd_ascend", libpath = "", pure = true, symbol = "jtd_acl_ptr_delta"} : (i64, i32) -> i64
        %reinterpret_cast = memref.reinterpret_cast %arg2 to offset: [%1], sizes: [1], strides: [1] : memref<?xi32> to memref<1xi32, strided<[1], offset: ?>>
        %intptr_0 = memref.extract_aligned_pointer_as_index %reinterpret_cast : memref<1xi32, strided<[1], offset: ?>> -> index
        %12 = arith.index_cast %intptr_0 : index to i64
        %13 = tt.extern_elementwise %12, %arg9, %0 {libname = "jtd_ascend", libpath = "", pure = false, symbol = "jtd_acl_notify_set"} : (i64, i32, i32) -> i32
        %14 = tt.extern_elementwise %12, %c0_i32, %arg9 {libname = "jtd_ascend", libpath = "", pure = false, symbol = "jtd_acl_wait_until"} : (i64, i32, i32) -> i32
        %15 = tt.extern_elementwise  {libname = "jtd_ascend", libpath = "", pure = false, symbol = "jtd_acl_fence"} : () -> i32
        return
      }
    }
""")


def test_aclshmem_placeholders_become_dist_calls_on_the_flag_memref():
    out = aclshmem_calls.rewrite(LINALG)
    assert "tt.extern_elementwise" not in out
    assert ('%0 = hivm.hir.custom {hivm.is_distributed, no_side_effect, '
            'hivm.pipe = #hivm.pipe<PIPE_S>, hivm.tcore_type = #hivm.tcore_type<VECTOR>, '
            'hivm.vf_mode = #hivm.vf_mode<SIMD>, symbol = "aclshmem_team_my_pe"} '
            '"dist.aclshmem_team_my_pe" ins(%arg12 : i32) -> i32') in out
    # symm_at: aclshmem_ptr of a one-element view of the barrier area, as a distance
    assert ("memref.reinterpret_cast %arg11 to offset: [0], sizes: [1], strides: [1] : "
            "memref<?xi64> to memref<1xi64, strided<[1]>>") in out
    assert '"dist.aclshmem_ptr_int64" ins(%jtd_view' in out
    assert "%jtd_7_delta = arith.subi %jtd_7_addr, %intptr : index" in out
    assert "%7 = arith.index_cast %jtd_7_delta : index to i64" in out
    # notify and wait take the flag's memref view, with its offset
    assert ('commScope = 2 : i32, sigOp = 0 : i32, symbol = "aclshmem_int32_p"} '
            '"dist.aclshmem_int32_p" ins(%reinterpret_cast, %arg9, %0 : '
            'memref<1xi32, strided<[1], offset: ?>>, i32, i32)') in out
    wait = [line for line in out.splitlines() if "aclshmem_wait_until_int32" in line][0]
    assert "no_side_effect" not in wait  # a wait must never be deletable
    assert "ins(%reinterpret_cast, %c0_i32, %arg9 :" in wait
    assert '"dist.aclshmem_fence"' in out and "%15 = arith.constant 0 : i32" in out


def test_aclshmem_rewrite_names_the_primitive_it_cannot_form():
    untraced = LINALG.replace("%12 = arith.index_cast %intptr_0 : index to i64",
                              "%12 = arith.addi %x, %y : i64")
    with pytest.raises(aclshmem_calls.RewriteError) as error:
        aclshmem_calls.rewrite(untraced)
    assert error.value.primitive == "notify"
    wide_add = LINALG.replace("memref<1xi32", "memref<1xi64").replace(
        "jtd_acl_notify_set", "jtd_acl_notify_add")
    with pytest.raises(aclshmem_calls.RewriteError, match="32-bit signals only"):
        aclshmem_calls.rewrite(wide_add)


def test_definitions_resolve_to_the_enclosing_region():
    lines = Lines(textwrap.dedent("""\
        %a = arith.constant 1 : i32
        scf.if %c {
          %b = arith.constant 2 : i32
        } else {
          %b = arith.constant 3 : i32
          %use = arith.addi %b, %a : i32
        }
        %after = arith.addi %b, %a : i32
    """))
    pattern = r"{name} = arith\.constant (\d+)"
    assert lines.definition(5, "%b", pattern).group(1) == "3"  # its own branch's %b
    assert lines.definition(5, "%a", pattern).group(1) == "1"
    assert lines.definition(7, "%b", pattern) is None  # neither branch is visible after


HIVM_SPIN = textwrap.dedent("""\
    func.func @k(%arg3: memref<?xi32>) {
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %c7 = arith.constant 7 : index
      scf.for %i = %c0 to %c7 step %c1 {
        %reinterpret_cast = memref.reinterpret_cast %arg3 to offset: [%i], sizes: [1], strides: [1] : memref<?xi32> to memref<1xi32, strided<[1], offset: ?>>
        %cast_1 = memref.cast %reinterpret_cast : memref<1xi32, strided<[1], offset: ?>> to memref<?xi32>
        hivm.hir.pipe_barrier[<PIPE_ALL>]
        call @store_ubuf_to_gm_1d_int32_t(%cast_0, %cast_1, %c0_i32) : (memref<?xi32>, memref<?xi32>, i32) -> ()
      }
      scf.while (%arg14 = %9) : (i32) -> () {
        scf.condition(%10)
      } do {
        func.call @load_gm_to_ubuf_1d_int32_t(%cast_16, %cast_17, %c0_i32) : (memref<?xi32>) -> ()
        scf.yield %15 : i32
      }
      %view = memref.view %arg2[%c0][] : memref<?xi8> to memref<1xi32>
      %cast_1 = memref.cast %view : memref<1xi32> to memref<?xi32>
      call @store_ubuf_to_gm_1d_int32_t(%cast_0, %cast_1, %c0_i32) : (memref<?xi32>, memref<?xi32>, i32) -> ()
      hivm.hir.pipe_barrier[<PIPE_ALL>]
      return
    }
""")


def test_hivm_counts_follow_loops_and_skip_the_compilers_own_stores():
    counts = checks.count_hivm(HIVM_SPIN)
    # 7 flag stores in the loop; the store to the workspace view is the compiler's own
    assert counts == checks.Counts(notifies=7, waits=1, barriers=8)


def test_ttir_counts_and_the_check_verdict():
    ttir = textwrap.dedent("""\
        %c1_i32 = arith.constant 1 : i32
        %c8_i32 = arith.constant 8 : i32
        scf.for %arg5 = %c1_i32 to %c8_i32 step %c1_i32  : i32 {
          gpu.barrier
          tt.store %23, %c1_i32 : !tt.ptr<i32>
        }
        %26 = tt.load %25 {isVolatile = true} : tensor<8x!tt.ptr<i32>>
        scf.while (%arg5 = %26) : (tensor<8xi32>) -> () {
          scf.condition(%33)
        } do {
          %32 = tt.load %25 {isVolatile = true} : tensor<8x!tt.ptr<i32>>
          scf.yield %32 : tensor<8xi32>
        }
        gpu.barrier
        tt.store %30, %31 : tensor<1024x!tt.ptr<f32>>
    """)
    counts = checks.count_ttir(ttir, "args")
    assert counts == checks.Counts(notifies=7, waits=1, barriers=8)
    expected = catalog.Expected(notifies=7, waits=1)
    assert checks.check(expected, counts, counts) == []
    lost = checks.Counts(notifies=7, waits=0, barriers=8)
    assert checks.check(expected, counts, lost) == [
        "hivm has 0 waits, the source implies 1"]


def _kernels_in_sources() -> set[str]:
    """``module:function`` of every ``@triton.jit`` function named ``*_kernel`` in
    kernels/."""
    import jax_triton_dist.kernels as kernels

    found = set()
    for path in pathlib.Path(kernels.__file__).parent.glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel"):
                found.add(f"jax_triton_dist.kernels.{path.stem}:{node.name}")
    return found


@pytest.mark.parametrize("ranks", catalog.RANKS)
def test_catalog_holds_every_kernel_with_every_parameter(ranks):
    cases = catalog.cases(ranks)
    extra = {"jax_triton_dist.ascend.device_calls:device_calls_kernel"}
    assert {case.kernel for case in cases} == _kernels_in_sources() | extra
    assert len({case.name for case in cases}) == len(cases)
    for case in cases:
        signature, constants = case.signature()
        params = list(inspect.signature(case.resolve().fn).parameters)
        assert list(signature) == params, case.name
        assert set(constants) == {p for p, t in signature.items() if t == "constexpr"}


def test_catalog_rejects_a_case_missing_a_parameter():
    case = catalog.cases(2)[0]
    broken = catalog.Case(case.name, case.kernel, case.pointers, {}, case.constexprs,
                          case.expected)
    with pytest.raises(ValueError, match="no value for parameter n"):
        broken.signature()


def test_gemm_tiles_per_target():
    # CUDA: the table the fused ops always used; Ascend: tiles that fit its 192 KiB buffer
    assert tiles.gemm_tiles(8192, 8192, 8192, target="cuda") == {
        "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8}
    assert tiles.gemm_tiles(128, 1376, 4096)["BLOCK_K"] == 128
    for m, n, k in ((8192, 8192, 8192), (128, 1376, 4096), (256, 1024, 1024)):
        ascend = tiles.gemm_tiles(m, n, k, copies=8, target="ascend")
        shape = (ascend["BLOCK_M"], ascend["BLOCK_N"], ascend["BLOCK_K"])
        assert shape in ((128, 128, 32), (64, 64, 64)), shape
    with pytest.raises(ValueError, match="target must be one of"):
        tiles.gemm_tiles(1, 1, 1, target="tpu")
    assert tiles.exchange_block(10_000) == (4096, 3)


def test_lower_command_without_the_environment_says_how_to_make_it(tmp_path, monkeypatch,
                                                                  capsys):
    monkeypatch.delenv(ascend_cli.PYTHON_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    code = ascend_cli.main(["lower", "--out", str(tmp_path / "out"),
                            "--python", str(tmp_path / "missing")])
    assert code == 2
    err = capsys.readouterr().err
    assert "no triton-ascend environment found" in err
    assert ascend_cli.INSTALL_LINE in err
    with pytest.raises(SystemExit):
        ascend_cli.main(["lower", "--out", "x", "--ranks", "0"])


def test_lower_without_out_uses_jtd_dump_ir(tmp_path, monkeypatch, capsys):
    import pytest

    from jax_triton_dist.ascend import __main__ as ascend_main

    monkeypatch.delenv("JTD_DUMP_IR", raising=False)
    with pytest.raises(SystemExit):
        ascend_main.main(["lower", "--python", "/nonexistent/python"])
    assert "--out is required (or set JTD_DUMP_IR" in capsys.readouterr().err
    seen = {}
    monkeypatch.setenv("JTD_DUMP_IR", str(tmp_path))
    monkeypatch.setattr(ascend_main, "ascend_python", lambda explicit=None: "python-ascend")
    monkeypatch.setattr(ascend_main.subprocess, "run",
                        lambda command, env: seen.setdefault("cmd", command) and type(
                            "R", (), {"returncode": 0})())
    assert ascend_main.main(["lower", "--kernels", "ring_shift_kernel"]) == 0
    out = seen["cmd"][seen["cmd"].index("--out") + 1]
    assert out == str(tmp_path / "ascend")


def test_a_crash_of_the_adapter_tool_is_retried_and_noted():
    """triton-adapter-opt crashing (a stack dump, or killed by a signal) is retried on the
    same input and noted; an input the tool rejects fails at once; crashes past the
    attempts raise."""
    import subprocess

    def crash(code=-11, stderr="Stack dump:\n#0 0x1 triton-adapter-opt"):
        return subprocess.CalledProcessError(code, ["triton-adapter-opt"], stderr=stderr)

    outcomes = [crash(), crash(1, "PLEASE submit a bug report ... Stack dump:"), "linalg"]

    def stage():
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    notes = []
    assert lowering.retry_tool_crashes(stage, "triton-adapter-opt", notes) == "linalg"
    assert len(notes) == 2 and "attempt 1" in notes[0] and "return code -11" in notes[0]

    rejected = crash(1, "error: failed to legalize operation 'tt.foo'")
    assert not lowering.tool_crashed(rejected)
    calls = []

    def rejects():
        calls.append(1)
        raise rejected

    with pytest.raises(subprocess.CalledProcessError):
        lowering.retry_tool_crashes(rejects, "triton-adapter-opt", [])
    assert len(calls) == 1

    def always_crashes():
        calls.append(1)
        raise crash()

    calls.clear()
    notes = []
    with pytest.raises(subprocess.CalledProcessError):
        lowering.retry_tool_crashes(always_crashes, "triton-adapter-opt", notes)
    assert len(calls) == lowering.TOOL_CRASH_ATTEMPTS and len(notes) == len(calls) - 1
