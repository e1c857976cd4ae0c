"""`ShardedJaxOp` on simulated CPU devices (conftest.py): a JAX function over a 1-D mesh, called on
whole torch tensors and on lists of shards, differentiated, compiled, copied; oracle: the same
function written in torch."""

import copy
import pickle

import jax
import jax.numpy as jnp
import pytest
import torch

from jaxattn.bridge import ShardedJaxOp, resolve_mesh

pytestmark = pytest.mark.skipif(len(jax.devices("cpu")) < 4, reason="needs 4 simulated CPU devices (conftest.py)")


def centered(x, ids, *, mesh, alpha):
    """x (B, L, E) and ids (B, L) split along L: (alpha x - mean over L (across devices) + ids, sum over E)."""
    y = alpha * x - x.mean(axis=1, keepdims=True) + ids[..., None].astype(x.dtype)
    return y, x.sum(axis=-1)


def centered_backward(x, ids, y, s, dy, ds, *, mesh, alpha):
    _, vjp = jax.vjp(lambda x_: centered(x_, ids, mesh=mesh, alpha=alpha), x)
    return vjp((dy, ds))


OP = ShardedJaxOp(centered, backward=centered_backward, name="tests.centered", num_outputs=2, in_dims=(1, 1),
                  out_dims=(1, 1))


def torch_centered(x, ids, alpha):
    return alpha * x - x.mean(dim=1, keepdim=True) + ids[..., None].to(x.dtype), x.sum(dim=-1)


def _case(length=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, length, 3, generator=gen)
    ids = torch.randint(0, 5, (2, length), generator=gen, dtype=torch.int32)
    return x, ids, (torch.randn(2, length, 3, generator=gen), torch.randn(2, length, generator=gen))


def _mesh(n=4):
    return tuple(d.id for d in jax.devices("cpu")[:n]), "sp"


@pytest.mark.parametrize("length", [8, 6])  # 6: not a multiple of the mesh size, replicated for the call
def test_whole_tensors_values_and_gradients(length):
    x, ids, (cy, cs) = _case(length)
    leaf, ref_leaf = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y, s = OP(leaf, ids, mesh=_mesh(), alpha=0.5)
    y_ref, s_ref = torch_centered(ref_leaf, ids, 0.5)
    torch.testing.assert_close((y, s), (y_ref, s_ref))
    ((y * cy).sum() + (s * cs).sum()).backward()
    ((y_ref * cy).sum() + (s_ref * cs).sum()).backward()
    torch.testing.assert_close(leaf.grad, ref_leaf.grad)


def test_shards_in_shards_out():
    x, ids, (cy, cs) = _case()
    shards = [c.clone().requires_grad_(True) for c in x.chunk(4, dim=1)]
    ys, ss = OP(shards, list(ids.chunk(4, dim=1)), mesh=_mesh(), alpha=2.0)
    assert isinstance(ys, list) and len(ys) == 4 and ys[0].shape == (2, 2, 3) and ss[0].shape == (2, 2)
    ref = x.clone().requires_grad_(True)
    y_ref, s_ref = torch_centered(ref, ids, 2.0)
    torch.testing.assert_close((torch.cat(ys, dim=1), torch.cat(ss, dim=1)), (y_ref, s_ref))
    # only one output gets a cotangent: the other's is zero
    sum((y * c).sum() for y, c in zip(ys, cy.chunk(4, dim=1))).backward()
    (y_ref * cy).sum().backward()
    torch.testing.assert_close(torch.cat([t.grad for t in shards], dim=1), ref.grad)


def scaled(x, w, *, mesh):
    """x (B, L, E) split along L, w (E,) replicated: x * w (one output)."""
    return x * w


def scaled_backward(x, w, y, dy, *, mesh):
    return (dy * w,)  # w is replicated: no gradient


SCALED = ShardedJaxOp(scaled, backward=scaled_backward, name="tests.scaled", num_outputs=1, in_dims=(1, None),
                      out_dims=(1,))


def test_replicated_argument():
    """in_dims None: every device gets all of w (whole tensor, or one copy per device with shards);
    x gets its gradient, w none."""
    x, _, (cy, _) = _case()
    w = torch.tensor([0.5, -2.0, 3.0], requires_grad=True)
    leaf = x.clone().requires_grad_(True)
    y = SCALED(leaf, w, mesh=_mesh())
    torch.testing.assert_close(y, x * w.detach())
    (y * cy).sum().backward()
    torch.testing.assert_close(leaf.grad, cy * w.detach())
    assert w.grad is None
    shards = [c.clone().requires_grad_(True) for c in x.chunk(4, dim=1)]
    ys = SCALED(shards, [w.detach()] * 4, mesh=_mesh())
    torch.testing.assert_close(torch.cat(ys, dim=1), x * w.detach())
    sum((y_ * c).sum() for y_, c in zip(ys, cy.chunk(4, dim=1))).backward()
    torch.testing.assert_close(torch.cat([t.grad for t in shards], dim=1), cy * w.detach())


def test_compile_fullgraph():
    x, ids, _ = _case()
    mesh = _mesh()
    compiled = torch.compile(lambda a, b: OP(a, b, mesh=mesh, alpha=0.25), fullgraph=True)
    torch.testing.assert_close(compiled(x, ids), torch_centered(x, ids, 0.25))


def test_copies_are_the_op_and_second_order_is_refused():
    assert copy.deepcopy(OP) is OP and pickle.loads(pickle.dumps(OP)) is OP
    x, ids, _ = _case()
    leaf = x.clone().requires_grad_(True)
    y, _ = OP(leaf, ids, mesh=_mesh(), alpha=1.0)
    with pytest.raises(NotImplementedError, match="tests.centered: second-order gradients"):
        torch.autograd.grad(y.sum(), leaf, create_graph=True)


def test_argument_errors():
    x, ids, _ = _case()
    with pytest.raises(TypeError, match="tensors, or lists of shards, in every"):
        OP(x, list(ids.chunk(4, dim=1)), mesh=_mesh(), alpha=1.0)
    with pytest.raises(TypeError, match="static Python constant"):
        OP(x, ids, mesh=_mesh(), alpha=[1.0])


def test_resolve_mesh():
    cpu = jax.devices("cpu")
    assert resolve_mesh(None, ("cpu",), True) == (True, tuple(d.id for d in jax.local_devices(backend="cpu")), "sp")
    assert resolve_mesh(None, ("cpu",) * 2, False) == (False, (cpu[0].id, cpu[1].id), "sp")
    mesh = jax.sharding.Mesh(cpu[:2], ("seq",))
    assert resolve_mesh(mesh, ("cpu",), True) == (True, (cpu[0].id, cpu[1].id), "seq")
    with pytest.raises(ValueError, match="^tensors: 3 shard\\(s\\)"):
        resolve_mesh(mesh, ("cpu",) * 3, False)
    with pytest.raises(TypeError, match="mesh=3"):
        resolve_mesh(3, ("cpu",), True)
