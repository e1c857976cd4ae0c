"""Automatic launch and the Hopper kernels: a long head-dim-128 call launches natively (and so runs the
Hopper kernels on sm90) with or without gradients; when the need of gradients is unknown, JAX's cuDNN
keeps it.

No GPU here: the launcher is told it can launch on CUDA and that Mosaic GPU can run; the rest of the
decision (sizes, features, grad) is the real one. On an H100 `tests/test_gpu_hopper.py` runs the kernels.
"""

import pytest

torch = pytest.importorskip("torch")

from jaxattn.torch_api import hopper_flash, scaled_dot_product_attention, sdpa_launcher  # noqa: E402
from jaxattn.torch_api import launch as launch_module  # noqa: E402
from jaxattn.torch_api.launch import describe, native_decision  # noqa: E402

CUDA = torch.device("cuda")


@pytest.fixture
def cuda_launcher(monkeypatch):
    monkeypatch.setattr(launch_module, "can_launch", lambda device: True)
    monkeypatch.setattr(hopper_flash, "mosaic_reasons", lambda device: [])


def _inputs(l=16384, s=16384, d=128, dtype=torch.bfloat16, features=("causal",), b=2, hq=16, hk=8):
    # (2, 16, 16384, 16384): far above XLA_CUDNN_MIN_WORK, where automatic launch keeps JAX's cuDNN.
    return describe((b, hq, l, d), (b, hk, s, d), d, dtype, set(features))


def test_a_long_call_launches_natively_with_or_without_gradients(cuda_launcher):
    native, why = native_decision(_inputs(), CUDA, None, "auto", grad=False)
    assert native and "the Hopper kernels (no gradients) measured faster" in why, why
    native, why = native_decision(_inputs(), CUDA, None, "auto", grad=True)
    assert native and "the Hopper kernels with gradients measured faster" in why, why
    native, why = native_decision(_inputs(), CUDA, None, "auto", grad=None)  # unknown: JAX's cuDNN
    assert not native and "measured faster here" in why, why


@pytest.mark.parametrize("change, want", [
    (dict(d=80), "head dims 80/80: the Hopper kernels run head dims (64, 128, 256) with gradients"),
    (dict(l=2048, s=2048), "S=2048 below 4096 with gradients"),
])
def test_calls_the_hopper_backward_cannot_run_keep_jax_cudnn(cuda_launcher, change, want):
    inputs = _inputs(**change)
    assert any(want in r for r in hopper_flash.hopper_launch_reasons(inputs, CUDA, grad=True)), want
    native, why = native_decision(inputs, CUDA, None, "auto", grad=True)
    assert "Hopper" not in why, why


@pytest.mark.parametrize("change, want", [
    (dict(d=80), "head dims 80/80"),
    (dict(dtype=torch.float32), "dtype float32"),
    (dict(features=("causal", "bool_mask")), "features ['bool_mask']"),
    (dict(l=2048), "S=16384 below 4096"),
])
def test_calls_the_hopper_forward_cannot_run_keep_their_launcher(cuda_launcher, change, want):
    inputs = _inputs(**change)
    assert any(want in r for r in hopper_flash.hopper_launch_reasons(inputs, CUDA, grad=False)), want
    native, why = native_decision(inputs, CUDA, None, "auto", grad=False)
    assert "Hopper" not in why


def test_head_dim_256_takes_the_hopper_kernels_with_and_without_gradients(cuda_launcher):
    inputs = _inputs(d=256)
    assert hopper_flash.hopper_launch_reasons(inputs, CUDA, grad=False) == []
    assert hopper_flash.hopper_launch_reasons(inputs, CUDA, grad=True) == []


@pytest.mark.parametrize("change", [dict(d=64), dict(l=16001, s=9000), dict(features=("sliding_window", "softcap"))])
def test_head_dim_64_windows_soft_caps_and_partial_tiles_take_the_hopper_kernels(cuda_launcher, change):
    for grad in (False, True):
        assert hopper_flash.hopper_launch_reasons(_inputs(**change), CUDA, grad=grad) == []


def test_deterministic_mode_keeps_jax_cudnn(cuda_launcher):
    torch.use_deterministic_algorithms(True)
    try:
        for grad in (False, True):
            assert not native_decision(_inputs(), CUDA, None, "auto", grad=grad)[0]
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("entry", ["drop-in", "flash_attention"])
def test_calls_tell_the_decision_whether_they_need_gradients(monkeypatch, entry):
    """Automatic launch at long lengths chooses by it (`native_decision`): the drop-in's prepared calls
    and `flash_attention` say whether autograd wants gradients."""
    from jaxattn.torch_api import flash_attention

    call = {"drop-in": lambda q, k, v, causal: scaled_dot_product_attention(q, k, v, is_causal=causal),
            "flash_attention": lambda q, k, v, causal: flash_attention(q, k, v, causal=causal)}[entry]
    seen = []
    real = launch_module.use_native

    def spy(inputs, device, choice, launcher, *, grad=None):
        seen.append(grad)
        return real(inputs, device, choice, launcher, grad=grad)

    monkeypatch.setattr(launch_module, "use_native", spy)
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 37, 8, generator=gen) for _ in range(3))
    call(q, k, v, True)
    call(q, k, v.requires_grad_(True), True)
    with torch.no_grad():
        call(q, k, v, False)
    assert seen == [False, True, False]


@pytest.mark.parametrize("persistent, b, hq, hk, keys, d, want", [
    # the persistent grid: at least 512 items (about four per program)
    (True, 1, 16, 8, 8192, 128, 1),    # 512 items unsplit
    (True, 1, 16, 2, 8192, 128, 4),    # 128 unsplit: four splits give 512
    (True, 1, 32, 8, 4096, 128, 2),    # 256: two splits give 512
    (True, 1, 32, 8, 8192, 64, 1),     # model B's shapes: 512 unsplit
    (True, 2, 32, 8, 4096, 64, 1),
    (True, 1, 16, 16, 128, 64, 1),     # no GQA: nothing to split
    (True, 1, 32, 8, 1024, 64, 4),     # 64 items: the whole group of 4 (256)
    # one program per item: head dim 128 wants 528 programs, head dim 64 2048
    (False, 1, 16, 8, 8192, 128, 2),   # 512 programs unsplit: two splits give 1024
    (False, 1, 16, 2, 8192, 128, 8),   # 128 programs: the whole group of 8
    (False, 4, 16, 2, 8192, 128, 2),   # 512: 2
    (False, 1, 16, 8, 16384, 128, 1),  # 1024 programs already
    (False, 1, 32, 8, 4096, 128, 4),   # 256 programs: the whole group of 4 (1024)
    (False, 1, 32, 8, 8192, 64, 4),    # head dim 64 wants 2048: 512 programs unsplit, the whole group of 4
    (False, 1, 32, 8, 16384, 64, 2),   # 1024 unsplit: two splits give 2048
    (False, 1, 32, 8, 32768, 64, 1),   # 2048 already
])
def test_the_hopper_backward_splits_short_gqa_grids(persistent, b, hq, hk, keys, d, want):
    from jaxattn.jax_core.calls import HOPPER_BACKWARD_MIN_ITEMS, hopper_head_splits

    got = hopper_head_splits(b, hq, hk, keys, d, persistent=persistent)
    assert got == want
    group, blocks = hq // hk, keys // 128
    assert group % got == 0
    least = HOPPER_BACKWARD_MIN_ITEMS["persistent" if persistent else "per_item"][d]
    assert b * hk * got * blocks >= least or got == group


@pytest.mark.parametrize("d, s, backward, want_block_kv, want_keys", [
    (64, 1000, False, 128, 1024),   # a short head-dim-64 walk: 128-key blocks
    (64, 1024, False, 128, 1024),
    (64, 1025, False, 256, 1280),   # past the bound: 256-key blocks
    (64, 2048, False, 256, 2048),
    (64, 4096, False, 256, 4096),
    (128, 1000, False, 128, 1024),  # head dim 128: one tile size
    (64, 1000, True, 64, 1024),     # the backward's tiles do not depend on the length
])
def test_the_hopper_forward_takes_shorter_key_blocks_for_short_head_dim_64_walks(d, s, backward, want_block_kv,
                                                                                   want_keys):
    from jaxattn.jax_core.calls import hopper_padded_lengths, hopper_tiles

    which = "backward" if backward else "forward"
    assert hopper_tiles(which, d, s)["block_kv"] == want_block_kv
    assert hopper_padded_lengths(97, s, d, backward=backward)[1] == want_keys
    # The padded length chooses the same tiles as the true one (the kernel sees the padded keys).
    assert hopper_tiles(which, d, want_keys) == hopper_tiles(which, d, s)


@pytest.mark.parametrize("compute_wgs, want_rows", [(2, 128), (3, 192)])
def test_padded_lengths_follow_the_forward_tiles_compute_warpgroups(monkeypatch, compute_wgs, want_rows):
    """The forward's tiles are compute_wgs * block_q rows: the lengths a caller pads to (and the LSE's
    rows) follow a tile setting that names three compute warpgroups; the backward's do not."""
    from jaxattn.jax_core import calls

    tiles = dict(block_q=64, block_kv=128, stages=2) | ({} if compute_wgs == 2 else dict(compute_wgs=3))
    monkeypatch.setitem(calls.HOPPER_FORWARD_SHORT, 64, (2048, tiles))
    calls.hopper_padded_lengths.cache_clear()
    try:
        assert calls.hopper_padded_lengths(97, 1000, 64, backward=False) == (want_rows, 1024)
        assert calls.hopper_padded_lengths(97, 1000, 64, backward=True)[0] == 128
    finally:
        calls.hopper_padded_lengths.cache_clear()

@pytest.mark.parametrize("hq, hk", [(4, 4), (8, 2)], ids=["mha", "gqa"])
def test_contiguous_heads_first_memory_folds_into_the_batch_without_a_copy(hq, hk):
    """Contiguous (B, H, T, D) memory, GQA included, reaches the kernels as (B*H, T, 1, D) views of the
    same storage; the kernels map query pair b*Hq + h to KV pair (b*Hq + h) // (Hq/Hk) = b*Hk + h // (Hq/Hk)."""
    from jaxattn.jax_core.kernels.flash_mgpu_checks import batch_group

    q = torch.randn(2, hq, 256, 64)
    k, v = torch.randn(2, hk, 384, 64), torch.randn(2, hk, 384, 64)
    (kq, kk, kv), folded = hopper_flash._kernel_views((q, k, v), (256, 384, 384))
    assert folded
    assert [t.shape for t in (kq, kk, kv)] == [(2 * hq, 256, 1, 64), (2 * hk, 384, 1, 64), (2 * hk, 384, 1, 64)]
    assert [t.data_ptr() for t in (kq, kk, kv)] == [t.data_ptr() for t in (q, k, v)]
    group = batch_group(kq, kk)
    for b in range(2):
        for h in range(hq):
            assert torch.equal(kk[(b * hq + h) // group, :, 0], k[b, h // (hq // hk)])


def _spy_hopper_kernels(monkeypatch) -> list:
    """Which Hopper kernels run (their names, in order), each still launching."""
    ran = []
    for name in ("_FORWARD", "_BACKWARD"):
        real = getattr(hopper_flash, name)
        monkeypatch.setattr(hopper_flash, name,
                            lambda *a, _real=real, _name=name, **static: ran.append(_name) or _real(*a, **static))
    return ran


@pytest.fixture
def interpreted_hopper(monkeypatch):
    """The Hopper kernels interpreted on the CPU, Mosaic GPU said to run, and lengths from 64 taking them."""
    pytest.importorskip("jax")
    from mosaic_gpu_mode import MODE
    if MODE != "interpret":
        pytest.skip("runs the kernels in Mosaic GPU's interpret mode (a CPU backend)")
    from jaxattn.bridge.triton_launch import can_launch
    if not can_launch(torch.device("cpu")):
        pytest.skip("the native launcher runs on the CPU under TRITON_INTERPRET=1")
    from hopper_interpreted import use_interpreted_kernels
    use_interpreted_kernels(monkeypatch)
    monkeypatch.setattr(hopper_flash, "mosaic_reasons", lambda device: [])
    monkeypatch.setitem(hopper_flash.HOPPER_MIN_LENGTH, "forward", 64)
    monkeypatch.setitem(hopper_flash.HOPPER_MIN_LENGTH, "train", 64)
    return _spy_hopper_kernels(monkeypatch)


@pytest.mark.parametrize("d", [128, 256])  # 256: the backward whose warpgroups split the columns
def test_flash_attention_runs_the_hopper_kernels(interpreted_hopper, d):
    """`flash_attention` with a window and a soft cap, GQA and lengths that are not whole tiles, on the
    native launcher: both Hopper kernels run, and out, dq, dk, dv meet the float64 oracle (2x rule)."""
    from attention_reference import assert_dtype_rule, reference, reference_grads

    from jaxattn.torch_api import flash_attention

    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    b, hq, hk, l, s, dtype = 1, 4, 2, 130, 200, torch.float16
    q, do = (torch.randn(b, hq, l, d, generator=gen, dtype=torch.float64).to(dtype).double() for _ in range(2))
    k, v = (torch.randn(b, hk, s, d, generator=gen, dtype=torch.float64).to(dtype).double() for _ in range(2))
    kw = dict(causal=True, window=(40, 0), softcap=5.0, scale=0.8 / d ** 0.5)
    leaves = [x.to(dtype).requires_grad_(True) for x in (q, k, v)]
    with sdpa_launcher("native"):
        out = flash_attention(*leaves, causal_alignment="bottom_right", **kw)
    grads = torch.autograd.grad((out * do.to(dtype)).sum(), leaves)
    assert interpreted_hopper == ["_FORWARD", "_BACKWARD"], interpreted_hopper

    rkw = dict(kw, alignment="bottom_right")
    want, _, (dq, dk, dv, _, _) = reference_grads(q, k, v, do, **rkw)
    low_leaves = [x.to(dtype).requires_grad_(True) for x in (q, k, v)]
    low, _ = reference(*low_leaves, dtype=dtype, **rkw)
    low_grads = torch.autograd.grad((low * do.to(dtype)).sum(), low_leaves)
    for name, got, ref, theirs in zip(("out", "dq", "dk", "dv"), (out, *grads), (want, dq, dk, dv), (low, *low_grads)):
        assert_dtype_rule(name, got.double(), ref, theirs.double(), floor=4e-3 * max(1.0, ref.abs().max().item()))


def test_flash_attention_keeps_the_triton_kernels_for_a_returned_lse(interpreted_hopper):
    """A returned (differentiable) LSE: the Triton kernels run the call (the Hopper LSE is not)."""
    from jaxattn.torch_api import flash_attention

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 128, 128, generator=gen, dtype=torch.float16) for _ in range(3))
    with sdpa_launcher("native"):
        flash_attention(q, k, v, causal=True, return_lse=True)
    assert interpreted_hopper == []


@pytest.mark.parametrize("per_head", [1, 3])
def test_flash_attention_runs_sinks_on_the_hopper_kernels(interpreted_hopper, per_head):
    """Sinks (one or several logits per query head, merged by log-sum-exp first) through
    `flash_attention`: both Hopper kernels run, and out, dq, dk, dv and d sinks meet the float64 oracle."""
    from attention_reference import assert_dtype_rule, reference, reference_grads

    from jaxattn.torch_api import flash_attention

    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    b, hq, hk, l, s, d, dtype = 1, 4, 2, 128, 256, 64, torch.float16
    q, do = (torch.randn(b, hq, l, d, generator=gen, dtype=torch.float64).to(dtype).double() for _ in range(2))
    k, v = (torch.randn(b, hk, s, d, generator=gen, dtype=torch.float64).to(dtype).double() for _ in range(2))
    sinks = torch.randn(hq, per_head, generator=gen, dtype=torch.float64).squeeze(-1) * 2
    kw = dict(causal=True, scale=0.8 / d ** 0.5)
    leaves = [x.to(dtype).requires_grad_(True) for x in (q, k, v)]
    sink_leaf = sinks.float().requires_grad_(True)
    with sdpa_launcher("native"):
        out = flash_attention(*leaves, sinks=sink_leaf, **kw)
    *grads, dsinks = torch.autograd.grad((out * do.to(dtype)).sum(), [*leaves, sink_leaf])
    assert interpreted_hopper == ["_FORWARD", "_BACKWARD"], interpreted_hopper

    want, _, (dq, dk, dv, _, want_dsinks) = reference_grads(q, k, v, do, sinks=sinks, **kw)
    low_leaves = [x.to(dtype).requires_grad_(True) for x in (q, k, v)]
    low, _ = reference(*low_leaves, sinks=sinks, dtype=dtype, **kw)
    low_grads = torch.autograd.grad((low * do.to(dtype)).sum(), low_leaves)
    for name, got, ref, theirs in zip(("out", "dq", "dk", "dv"), (out, *grads), (want, dq, dk, dv), (low, *low_grads)):
        assert_dtype_rule(name, got.double(), ref, theirs.double(), floor=4e-3 * max(1.0, ref.abs().max().item()))
    assert dsinks.shape == sinks.shape
    assert torch.allclose(dsinks.double(), want_dsinks, rtol=2e-2, atol=2e-2), (dsinks, want_dsinks)


def test_the_transformers_plugin_runs_soft_capped_layers_on_the_hopper_kernels(interpreted_hopper):
    """The plug-in's feature path (a soft cap, as Gemma 2's layers pass it) drops the LSE, so the Hopper
    kernels take its calls, forward and backward; the output matches the float64 oracle."""
    from attention_reference import reference

    from jaxattn.torch_api import transformers_plugin

    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 2, 128, 64, generator=gen, dtype=torch.float16).requires_grad_(True) for _ in range(3))
    with sdpa_launcher("native"):
        out = transformers_plugin._with_features(q, k, v, None, None, causal=True, scale=0.125, softcap=5.0,
                                                 dropout_p=0.0, implementation=None)
    out.sum().backward()
    assert interpreted_hopper == ["_FORWARD", "_BACKWARD"], interpreted_hopper
    want, _ = reference(*(x.detach().double() for x in (q, k, v)), causal=True, softcap=5.0, scale=0.125)
    assert (out.double() - want).abs().max().item() < 1e-2


def test_programs_decide_the_shorter_threshold_only_where_they_run(monkeypatch):
    """`hopper_program.may_run`, which lets a call take the Hopper kernels below `HOPPER_MIN_LENGTH`: whole
    tiles read in place, programs on, and a signature not settled without a program (then the Python
    path's threshold holds: its host time is what the threshold measures)."""
    from jaxattn.bridge import triton_program
    from jaxattn.jax_core.kernels.flash_plan import FlashConfig
    from jaxattn.torch_api import hopper_program

    monkeypatch.setenv(triton_program.ENV_SWITCH, "1")
    monkeypatch.setattr(hopper_program, "_PROGRAMS", {})
    cfg = FlashConfig(scale=0.1, causal=True)
    q, k, v = (torch.empty(2, 4, 1024, 128, dtype=torch.bfloat16) for _ in range(3))
    assert hopper_program.may_run(q, k, v, cfg, True)
    blhd = [torch.empty(2, 1024, h, 128, dtype=torch.bfloat16).transpose(1, 2) for h in (4, 2, 2)]
    assert hopper_program.may_run(*blhd, cfg, True)  # GQA in (B, L, H, D) memory: read in place
    assert not hopper_program.may_run(q[:, :, :1000], k, v, cfg, True)  # a partial tile: padded copies
    assert not hopper_program.may_run(q, *blhd[1:], cfg, True)  # mixed layouts: copies
    hopper_program._PROGRAMS[hopper_program.signature(q, k, v, cfg, True)] = -1  # registration failed
    assert not hopper_program.may_run(q, k, v, cfg, True)
    assert hopper_program.may_run(q, k, v, cfg, False)  # another signature
    monkeypatch.setenv(triton_program.ENV_SWITCH, "0")
    assert not hopper_program.may_run(q, k, v, cfg, False)


@pytest.mark.parametrize("flag, device, l, s, d, backward, want", [
    (False, "cuda", 104, 136, 128, False, (128, 256, False)),  # off: padded to whole tiles
    (True, "cuda", 104, 136, 128, False, (104, 136, True)),    # whole 8-row tiles: in place
    (True, "cuda", 104, 136, 64, True, (104, 136, True)),      # the backward at head dim 64 too
    (True, "cuda", 97, 136, 128, False, (128, 256, False)),    # L not in 8-row tiles: padded
    (True, "cuda", 128, 130, 128, True, (128, 256, False)),    # S not in 8-row tiles: padded
    (True, "cuda", 256, 384, 128, False, (256, 384, False)),   # whole kernel tiles: nothing past them
    (True, "cpu", 104, 136, 128, False, (128, 256, False)),    # interpreted kernels pad
])
def test_lengths_in_whole_tma_tiles_go_in_place_on_a_gpu_when_switched_on(monkeypatch, flag, device, l, s, d,
                                                                        backward, want):
    """`hopper_flash.kernel_lengths`: with `calls.HOPPER_TMA_EDGES`, on a GPU, lengths in whole 8-row
    TMA tiles reach the kernels in place (`tma_edges`, the last tiles running past them); otherwise, and
    always on the CPU (the interpreter refuses copies past an array's end), padded to whole tiles."""
    from jaxattn.jax_core import calls

    monkeypatch.setattr(calls, "HOPPER_TMA_EDGES", flag)
    assert hopper_flash.kernel_lengths(l, s, d, backward, torch.device(device)) == want
    assert calls.hopper_padded_lengths(l, s, d, backward, tma_edges=flag and device == "cuda") == want[:2]


def test_a_program_signature_holds_the_tma_edges_switch(monkeypatch):
    """A settled program answers for its signature only while `calls.HOPPER_TMA_EDGES` stands as it
    did: a length that is not whole tiles is padded with the switch off (no program) and read in place
    with it on (a program), so switching it must not reuse the other setting's answer."""
    from jaxattn.jax_core import calls
    from jaxattn.jax_core.kernels.flash_plan import FlashConfig
    from jaxattn.torch_api import hopper_program

    cfg = FlashConfig(scale=0.1, causal=True)
    q, k, v = (torch.empty(1, 2, 104, 64, dtype=torch.bfloat16) for _ in range(3))
    keys = []
    for flag in (False, True):
        monkeypatch.setattr(calls, "HOPPER_TMA_EDGES", flag)
        keys.append(hopper_program.signature(q, k, v, cfg, True))
    assert keys[0] != keys[1]
    monkeypatch.setattr(hopper_program, "_PROGRAMS", {keys[0]: -1})
    assert hopper_program.unsettled(keys[1]) and not hopper_program.unsettled(keys[0])


@pytest.mark.parametrize("b, hq, hk, l, d, programs, want", [
    (16, 16, 16, 1024, 64, 132, 2),  # an item walks 8 query blocks of 128 rows
    (8, 16, 16, 2048, 64, 132, 2),  # 16: the bound
    (8, 16, 16, 1024, 128, 132, 2),  # 16 blocks of 64 rows
    (8, 16, 16, 1032, 128, 132, 1),  # 17
    (4, 16, 16, 2048, 128, 132, 1),  # 32: long walks run without clusters (measured slower in them)
    (4, 16, 16, 4096, 64, 132, 1),
    (16, 16, 8, 1024, 64, 132, 2),  # GQA: an item walks its two query heads, 16 blocks
    (16, 16, 4, 1024, 64, 132, 1),  # four heads: 32
    (4, 16, 4, 1024, 64, 132, 2),  # a short grid splits the four heads (head_splits 4): 8
    (16, 16, 16, 1024, 64, 131, 1),  # an odd grid cannot pair its programs
    (16, 16, 16, 1024, 64, None, 1),  # one program per item
    (16, 16, 16, 1024, 256, 132, 1),  # head dim 256 runs without clusters
    (16, 16, 16, 1152, 64, 132, 1),  # 1152 keys: nine 128-key items, not whole pairs
])
def test_the_hopper_backward_runs_short_walks_in_clusters_of_two(monkeypatch, b, hq, hk, l, d, programs, want):
    """`calls.hopper_backward_cluster` through the torch launch's backward settings: clusters of two
    programs where an item walks at most HOPPER_BACKWARD_CLUSTER_MOST_STEPS query blocks on an even
    persistent grid and the keys are whole pairs of items."""
    from jaxattn.jax_core import calls
    from jaxattn.jax_core.kernels.flash_plan import FlashConfig

    assert calls.HOPPER_BACKWARD_CLUSTER_MOST_STEPS == 16
    monkeypatch.setattr(hopper_flash, "backward_programs", lambda device: programs)
    kq = torch.empty(b, l, hq, d, device="meta")
    kk = torch.empty(b, l, hk, d, device="meta")
    static = hopper_flash._backward_static(FlashConfig(scale=0.1, causal=True), l, kq, kk, CUDA, False)
    assert static["cluster"] == want, static
