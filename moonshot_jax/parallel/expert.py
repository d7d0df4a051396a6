"""Expert parallelism: routed-expert compute sharded over the "expert" mesh axis with `jax.shard_map`.

`make_expert_fn(mesh, ep)` returns a drop-in for LatentMoE's `routed_experts(x_TL, expert_idx_Tk,
expert_w_Tk, w_gate_ELF, w_up_ELF, w_down_EFL, cfg) -> y_TL`. Routing happens outside (replicated
router, global statistics under jit); inside the shard_map each device holds T/(data·expert) tokens
and E/expert experts, and:
  1. sorts its token copies by destination (expert -> owning rank),
  2. dispatches them over "expert":
       "dense":  fixed-capacity buffers [ranks, experts/rank, C, L] through `all_to_all`; copies past
                 capacity C = ceil(capacity_factor · copies / slots) are dropped and COUNTED
                 (stats "ep_dropped", "ep_drop_fraction", psummed over the whole mesh);
       "ragged": dropless `lax.ragged_all_to_all` into a worst-case buffer (GPU/TPU only —
                 XLA:CPU has no implementation; refused with a clear error before compiling),
  3. runs the expert MLPs ("dense": a batched matmul per local expert — the capacity layout is
     already grouped; "ragged": `lax.ragged_dot` over the rows regrouped by local expert),
  4. sends results back the same way and combines them with the routing weights.
The "tensor" axis is manual too: each device holds an F/tensor slice of every local expert and the
combined output is psummed over "tensor" (one [T, L] reduction instead of one per dispatched row).
"data" only splits tokens: experts are replicated over it (ZeRO-3 all-gathers them on entry).

Redundant experts (MoonEP-style, `ep.redundant_experts = R > 0`, R divisible by the expert axis):
every rank owns E/ep home slots plus R/ep replica slots; `placement_ER` ([ep, R/ep] expert ids, a
traced array — static shapes) says which experts the replicas copy, chosen by `redundant_placement`
from the previous step's loads. Copies of a replicated expert are spread over its home and replica
slots by token index. Replica weights are fetched with one masked psum of [R, ...] over "expert";
autodiff of that psum + select sums replica gradients back into the home expert's gradient.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from moonshot_jax.config import ModelConfig
from moonshot_jax.layers.ffn import gated_activation
from moonshot_jax.layers.moe import routed_experts

_DISPATCH = ("dense", "ragged")


@dataclasses.dataclass(frozen=True)
class EPConfig:
  dispatch: str = "dense"
  capacity_factor: float = 2.0
  redundant_experts: int = 0

  @classmethod
  def from_mesh_cfg(cls, mesh_cfg: Any) -> "EPConfig":
    """From the experiment's `mesh` section (ep_dispatch, capacity_factor, redundant_experts)."""
    return cls(dispatch=str(mesh_cfg.ep_dispatch), capacity_factor=float(mesh_cfg.capacity_factor),
               redundant_experts=int(mesh_cfg.redundant_experts))

  def validate(self, num_experts: int, ep_size: int) -> None:
    if self.dispatch not in _DISPATCH:
      raise ValueError(f"mesh.ep_dispatch: expected one of {_DISPATCH}, got {self.dispatch!r}")
    if not self.capacity_factor > 0:
      raise ValueError(f"mesh.capacity_factor: must be positive, got {self.capacity_factor}")
    if num_experts % ep_size:
      raise ValueError(f"mesh.expert: {ep_size} does not divide model.num_experts={num_experts}")
    r = self.redundant_experts
    if r < 0 or r % ep_size:
      raise ValueError(f"mesh.redundant_experts: must be >= 0 and a multiple of the expert axis "
                       f"({ep_size}), got {r}")


# ---- expert MLP math ---------------------------------------------------------------------------
def batched_expert_mlp(x_ENL: jax.Array, w_gate_ELF, w_up_ELF, w_down_EFL, cfg: ModelConfig) -> jax.Array:
  """Each expert e on its own rows x_ENL[e] (the capacity layout). Same numerics as
  layers.moe.routed_experts: inputs in cfg.dtype, fp32 accumulation, fp32 out."""
  dt = jnp.dtype(cfg.dtype)
  mm = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)
  x = x_ENL.astype(dt)
  g = mm("enl,elf->enf", x, w_gate_ELF.astype(dt))
  u = mm("enl,elf->enf", x, w_up_ELF.astype(dt))
  return mm("enf,efl->enl", gated_activation(g, u, cfg).astype(dt), w_down_EFL.astype(dt))


def grouped_expert_mlp(x_NL: jax.Array, group_sizes_E: jax.Array, w_gate_ELF, w_up_ELF, w_down_EFL,
                       cfg: ModelConfig) -> jax.Array:
  """Rows sorted by expert, `group_sizes_E` rows each (ragged_dot); rows past the groups' total
  come out 0. fp32 out."""
  dt = jnp.dtype(cfg.dtype)

  def gmm(lhs, rhs):
    return jax.lax.ragged_dot(lhs.astype(dt), rhs.astype(dt), group_sizes_E,
                              preferred_element_type=jnp.float32)

  y = gmm(gated_activation(gmm(x_NL, w_gate_ELF), gmm(x_NL, w_up_ELF), cfg), w_down_EFL)
  valid = jnp.arange(x_NL.shape[0]) < jnp.sum(group_sizes_E)
  return jnp.where(valid[:, None], y, 0)


def positions_in_group(group_N: jax.Array, num_groups: int) -> tuple[jax.Array, jax.Array]:
  """(rank of each element among earlier elements of its group, group sizes). O(N log N)."""
  n = group_N.shape[0]
  order = jnp.argsort(group_N, stable=True)
  sizes = jnp.bincount(group_N, length=num_groups)
  starts = jnp.cumsum(sizes) - sizes
  pos_sorted = jnp.arange(n, dtype=jnp.int32) - starts[group_N[order]]
  return jnp.zeros((n,), jnp.int32).at[order].set(pos_sorted), sizes


def _exclusive_cumsum(x: jax.Array, axis: int = -1) -> jax.Array:
  return jnp.cumsum(x, axis=axis) - x


# ---- redundant-expert placement ----------------------------------------------------------------
def redundant_placement(load_E: jax.Array, num_redundant: int, ep_size: int) -> jax.Array:
  """[ep, R/ep] expert ids for the replica slots, greedy from per-expert loads (e.g. last step's
  token counts): replicas go one by one to the expert with the highest load per copy, then each
  replica, hottest first, to the least-loaded rank with a free slot. Pure jnp, static shapes."""
  e = load_E.shape[0]
  if num_redundant % ep_size or e % ep_size:
    raise ValueError(f"redundant_placement: num_redundant={num_redundant} and num_experts={e} must be "
                     f"multiples of ep_size={ep_size}")
  r_loc, e_loc = num_redundant // ep_size, e // ep_size
  load = load_E.astype(jnp.float32)

  def pick(i, carry):
    copies, chosen = carry
    j = jnp.argmax(load / copies)
    return copies.at[j].add(1.0), chosen.at[i].set(j)

  copies, chosen = jax.lax.fori_loop(0, num_redundant, pick,
                                     (jnp.ones((e,), jnp.float32), jnp.zeros((num_redundant,), jnp.int32)))
  per_copy = load / copies
  rank_load = jnp.sum(per_copy.reshape(ep_size, e_loc), axis=1)
  chosen = chosen[jnp.argsort(-per_copy[chosen], stable=True)]

  def place(i, carry):
    rank_load, free, placed = carry
    j = chosen[i]
    rk = jnp.argmin(jnp.where(free > 0, rank_load, jnp.inf))
    slot = r_loc - free[rk]
    return (rank_load.at[rk].add(per_copy[j]), free.at[rk].add(-1), placed.at[rk, slot].set(j))

  _, _, placed = jax.lax.fori_loop(
      0, num_redundant, place,
      (rank_load, jnp.full((ep_size,), r_loc, jnp.int32), jnp.zeros((ep_size, r_loc), jnp.int32)))
  return placed


def _slot_table(placement_ER: jax.Array, num_experts: int, ep_size: int) -> tuple[jax.Array, jax.Array]:
  """(slot ids [E, 1+R] per copy of each expert (copy 0 = home), number of copies [E])."""
  r = placement_ER.size
  e_loc, r_loc = num_experts // ep_size, r // ep_size
  s_loc = e_loc + r_loc
  home = (jnp.arange(num_experts) // e_loc) * s_loc + jnp.arange(num_experts) % e_loc
  flat = placement_ER.reshape(r)
  rep_slot = (jnp.arange(r) // r_loc) * s_loc + e_loc + jnp.arange(r) % r_loc
  copy_no = 1 + positions_in_group(flat, num_experts)[0]
  table = jnp.zeros((num_experts, 1 + r), jnp.int32).at[:, 0].set(home).at[flat, copy_no].set(rep_slot)
  return table, 1 + jnp.bincount(flat, length=num_experts)


# ---- ragged all-to-all emulation (tests on CPU) ------------------------------------------------
def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                               *, axis_name):
  """Same contract as `lax.ragged_all_to_all`, built from `all_gather` + gathers: lets the ragged
  dispatch logic be tested on XLA:CPU (slow, memory-hungry; tests only)."""
  del recv_sizes  # implied by the senders' sizes
  me = jax.lax.axis_index(axis_name)
  ops = jax.lax.all_gather(operand, axis_name)  # [R, N, ...]
  in_off = jax.lax.all_gather(input_offsets, axis_name)[:, me]  # per source: its chunk for me
  size = jax.lax.all_gather(send_sizes, axis_name)[:, me]
  out_off = jax.lax.all_gather(output_offsets, axis_name)[:, me]
  rows = jnp.arange(output.shape[0])
  inside = (rows[None, :] >= out_off[:, None]) & (rows[None, :] < (out_off + size)[:, None])  # [R, M]
  src = jnp.argmax(inside, axis=0)
  covered = jnp.any(inside, axis=0)
  idx = jnp.clip(in_off[src] + rows - out_off[src], 0, operand.shape[0] - 1)
  got = ops[src, idx]
  return jnp.where(covered.reshape((-1,) + (1,) * (output.ndim - 1)), got, output)


# ---- the sharded routed-expert function --------------------------------------------------------
def _context_mesh(mesh: Mesh) -> Any:
  am = jax.sharding.get_abstract_mesh()
  return mesh if (am is None or am.empty) else am


def check_dispatch_supported(mesh: Mesh, ep: EPConfig, ragged_all_to_all: Callable | None = None) -> None:
  """The ragged path needs `ragged_all_to_all`, which XLA:CPU does not implement: refuse early."""
  if ep.dispatch == "ragged" and ragged_all_to_all is None:
    platforms = {d.platform for d in mesh.devices.flat}
    if "cpu" in platforms:
      raise ValueError("mesh.ep_dispatch='ragged' needs a GPU or TPU: XLA:CPU does not implement "
                       "lax.ragged_all_to_all. Use mesh.ep_dispatch='dense' (capacity-based all_to_all) on CPU.")


def make_expert_fn(mesh: Mesh, ep: EPConfig, *, with_stats: bool = False,
                   ragged_all_to_all: Callable | None = None) -> Callable:
  """Returns `fn(x_TL, expert_idx_Tk, expert_w_Tk, w_gate_ELF, w_up_ELF, w_down_EFL, cfg,
  placement_ER=None) -> y_TL` (or `(y_TL, stats)` with `with_stats`), sharded over the mesh.

  Tokens are split over ("data", "expert") (pipeline stays as the caller has it), expert weights
  over "expert" (and F over "tensor"). `ragged_all_to_all` overrides the collective of the ragged
  path (tests pass `emulated_ragged_all_to_all` to run it on CPU).
  """
  check_dispatch_supported(mesh, ep, ragged_all_to_all)
  a2a_ragged = ragged_all_to_all or jax.lax.ragged_all_to_all
  sizes = {a: int(mesh.shape.get(a, 1)) for a in ("data", "expert", "tensor")}
  ep_size = sizes["expert"]
  tok_axes = ("data", "expert")
  manual = frozenset(a for a in ("data", "expert", "tensor") if a in mesh.shape)

  def fn(x_TL, expert_idx_Tk, expert_w_Tk, w_gate_ELF, w_up_ELF, w_down_EFL, cfg: ModelConfig,
         placement_ER=None):
    e_total = w_gate_ELF.shape[0]
    ep.validate(e_total, ep_size)
    T, K = expert_idx_Tk.shape
    if x_TL.ndim != 2 or x_TL.shape[0] != T:
      raise ValueError(f"x_TL: expected [T={T}, L], got {x_TL.shape}")
    if expert_w_Tk.shape != (T, K):
      raise ValueError(f"expert_w_Tk: expected {(T, K)}, got {expert_w_Tk.shape}")
    if T % (sizes["data"] * ep_size):
      raise ValueError(f"x_TL: {T} tokens not divisible by data*expert={sizes['data'] * ep_size}")
    if w_gate_ELF.shape[2] % sizes["tensor"]:
      raise ValueError(f"w_gate_ELF: expert_ff_dim={w_gate_ELF.shape[2]} not divisible by tensor="
                       f"{sizes['tensor']}")
    r = ep.redundant_experts
    if r and placement_ER is None:
      placement_ER = jnp.zeros((ep_size, r // ep_size), jnp.int32) + jnp.arange(r // ep_size)
    if r == 0:
      placement_ER = jnp.zeros((ep_size, 0), jnp.int32)
    local = functools.partial(_local_ep, cfg=cfg, ep=ep, ep_size=ep_size, e_total=e_total,
                              a2a_ragged=a2a_ragged)
    tok = P(tok_axes)
    wspec_in = P("expert", None, "tensor")
    wspec_out = P("expert", "tensor", None)
    y, stats = jax.shard_map(
        local, mesh=_context_mesh(mesh), axis_names=manual,
        in_specs=(tok, tok, tok, wspec_in, wspec_in, wspec_out, P()),
        out_specs=(tok, P()))(x_TL, expert_idx_Tk, expert_w_Tk, w_gate_ELF, w_up_ELF, w_down_EFL,
                              placement_ER)
    return (y, stats) if with_stats else y

  return fn


def make_local_expert_fn(mesh: Mesh) -> Callable:
  """Dropless `layers.moe.routed_experts` run where the tokens are, for meshes with data / tensor
  axes but expert == 1. Without it GSPMD cannot split the global argsort / scatter of the blocked
  and ragged paths over "data": it all-gathers every token copy to every device, slower than one
  device (step times in WORKSPACE_NOTES). Each device routes its own T/data tokens through the full (replicated over "data") experts; with "tensor" each holds an
  F/tensor slice of every expert and the outputs are psummed over it, as in `make_expert_fn`."""
  sizes = {a: int(mesh.shape.get(a, 1)) for a in ("data", "tensor")}
  manual = frozenset(a for a in ("data", "tensor") if a in mesh.shape)
  tok = P("data")

  def fn(x_TL, expert_idx_Tk, expert_w_Tk, w_gate_ELF, w_up_ELF, w_down_EFL, cfg: ModelConfig):
    T = x_TL.shape[0]
    if T % sizes["data"]:
      raise ValueError(f"x_TL: {T} tokens not divisible by data={sizes['data']}")
    if w_gate_ELF.shape[2] % sizes["tensor"]:
      raise ValueError(f"w_gate_ELF: expert_ff_dim={w_gate_ELF.shape[2]} not divisible by tensor="
                       f"{sizes['tensor']}")

    def local(x, idx, w, wg, wu, wd):
      return jax.lax.psum(routed_experts(x, idx, w, wg, wu, wd, cfg), "tensor")

    return jax.shard_map(
        local, mesh=_context_mesh(mesh), axis_names=manual,
        in_specs=(tok, tok, tok, P(None, None, "tensor"), P(None, None, "tensor"), P(None, "tensor", None)),
        out_specs=tok)(x_TL, expert_idx_Tk, expert_w_Tk, w_gate_ELF, w_up_ELF, w_down_EFL)

  return fn


def _local_ep(x_TL, idx_Tk, w_Tk, wg, wu, wd, placement_ER, *, cfg, ep, ep_size, e_total, a2a_ragged):
  """Per-device body: T_loc tokens, E/ep home experts (F/tensor wide)."""
  T, K = idx_Tk.shape
  n = T * K
  e_loc = e_total // ep_size
  r_loc = placement_ER.shape[1]
  s_loc = e_loc + r_loc
  n_slots = s_loc * ep_size
  me = jax.lax.axis_index("expert")
  e_N = idx_Tk.reshape(n).astype(jnp.int32)

  # Local weights per slot: home experts, then replicas fetched from their home ranks.
  if r_loc:
    flat = placement_ER.reshape(-1)
    home_rank, home_local = flat // e_loc, flat % e_loc
    mine = (home_rank == me)[:, None, None]
    fetch = lambda w: jax.lax.psum(jnp.where(mine, w[home_local], 0), "expert").reshape(
        (ep_size, r_loc) + w.shape[1:])[me]
    wg, wu, wd = (jnp.concatenate([w, fetch(w)], axis=0) for w in (wg, wu, wd))
    table, n_copies = _slot_table(placement_ER, e_total, ep_size)
    # Spread copies of a replicated expert over its slots by (global) assignment index.
    gidx = jnp.arange(n) + (jax.lax.axis_index("data") * ep_size + me) * n
    slot_N = table[e_N, gidx % n_copies[e_N]]
  else:
    slot_N = e_N

  if ep.dispatch == "dense":
    cap = dense_capacity(n, n_slots, ep.capacity_factor)
    xin, route = dispatch_dense(x_TL, slot_N, k=K, n_slots=n_slots, ep_size=ep_size, cap=cap)
    y_N = return_dense(batched_expert_mlp(xin, wg, wu, wd, cfg).astype(xin.dtype), route, ep_size=ep_size)
    load_S, dropped = route["load_S"], jnp.sum(~route["keep_N"])
  else:
    y_N, load_S = _ragged_exchange(jnp.repeat(x_TL, K, axis=0), slot_N, wg, wu, wd, cfg=cfg, ep_size=ep_size,
                                   s_loc=s_loc, a2a=a2a_ragged)
    dropped = jnp.zeros((), jnp.int32)
    cap = 0

  y = jnp.sum(y_N.reshape(T, K, -1).astype(jnp.float32) * w_Tk[..., None].astype(jnp.float32), axis=1)
  y = y.astype(x_TL.dtype)
  y = jax.lax.psum(y, "tensor")  # partial sums of the F/tensor slices
  rank_load = jax.lax.psum(jnp.sum(load_S.reshape(ep_size, s_loc), axis=1), ("data", "expert"))
  total = jax.lax.psum(jnp.asarray(n, jnp.float32), ("data", "expert"))
  dropped = jax.lax.psum(dropped.astype(jnp.float32), ("data", "expert"))
  stats = dict(ep_dropped=dropped, ep_drop_fraction=dropped / total, ep_capacity=jnp.asarray(cap, jnp.int32),
               ep_rank_load_max_over_mean=jnp.max(rank_load) / jnp.maximum(jnp.mean(rank_load), 1e-9))
  return y, stats


def dense_capacity(num_copies: int, num_slots: int, capacity_factor: float) -> int:
  """Rows per (source rank, slot): the buffer holds capacity_factor × the copies it must carry."""
  return max(1, math.ceil(capacity_factor * num_copies / num_slots))


def dispatch_limits(tokens_per_rank: int, k: int, num_slots: int, capacity_factor: float) -> dict[str, Any]:
  """What "dense" dispatch can carry when each of a rank's `tokens_per_rank` tokens sends k copies
  to distinct slots: a slot receives at most one copy per token, so it overflows only when more
  than `capacity` of the rank's tokens pick it. dropless_factor: the capacity_factor from which
  no routing can drop (capacity reaches tokens_per_rank)."""
  cap = dense_capacity(tokens_per_rank * k, num_slots, capacity_factor)
  return dict(capacity=cap, can_drop=cap < tokens_per_rank, dropless_factor=num_slots / k)


def dispatch_dense(x_TL: jax.Array, slot_N: jax.Array, *, k: int, n_slots: int, ep_size: int, cap: int):
  """Inside shard_map over "expert": token copies (token-major, k per token) to the ranks owning their
  slots. Returns (rows [slots/rank, ep·cap, L] grouped by local slot, routing info for the way back).
  Copies past `cap` per (source, slot) are dropped, earliest tokens kept (stable order)."""
  n = slot_N.shape[0]
  s_loc = n_slots // ep_size
  pos_N, load_S = positions_in_group(slot_N, n_slots)
  keep_N = pos_N < cap
  dest_N = jnp.where(keep_N, slot_N * cap + pos_N, n_slots * cap)  # out of range -> dropped
  tok_N = jnp.arange(n) // k
  buf = jnp.zeros((n_slots * cap, x_TL.shape[1]), x_TL.dtype).at[dest_N].set(x_TL[tok_N], mode="drop")
  buf = jax.lax.all_to_all(buf.reshape(ep_size, s_loc * cap, -1), "expert", 0, 0, tiled=True)
  xin = buf.reshape(ep_size, s_loc, cap, -1).transpose(1, 0, 2, 3).reshape(s_loc, ep_size * cap, -1)
  return xin, dict(dest_N=dest_N, keep_N=keep_N, load_S=load_S)


def return_dense(y_SRL: jax.Array, route: dict, *, ep_size: int) -> jax.Array:
  """The inverse trip of `dispatch_dense`: per token copy its expert output (0 where dropped)."""
  s_loc, rc, l = y_SRL.shape
  cap = rc // ep_size
  y = y_SRL.reshape(s_loc, ep_size, cap, l).transpose(1, 0, 2, 3).reshape(ep_size, s_loc * cap, l)
  y = jax.lax.all_to_all(y, "expert", 0, 0, tiled=True).reshape(ep_size * s_loc * cap, l)
  dest_N = route["dest_N"]
  return jnp.where(route["keep_N"][:, None], y[jnp.minimum(dest_N, y.shape[0] - 1)], 0)


def _ragged_exchange(x_NL, slot_N, wg, wu, wd, *, cfg, ep_size, s_loc, a2a):
  """Dropless: rows sorted by slot go to their owning rank with ragged_all_to_all into a worst-case
  [ep·N, L] buffer, are regrouped by local slot for ragged_dot, and come back the same way."""
  n = x_NL.shape[0]
  n_slots = ep_size * s_loc
  order = jnp.argsort(slot_N, stable=True)
  counts_S = jnp.bincount(slot_N, length=n_slots).astype(jnp.int32)
  all_counts = jax.lax.all_gather(counts_S, "expert")  # [src, slots]
  per_rank = all_counts.reshape(ep_size, ep_size, s_loc)  # [src, dst, local slot]
  sizes = jnp.sum(per_rank, axis=2)  # [src, dst] rows
  me = jax.lax.axis_index("expert")
  send_sizes = sizes[me]
  input_offsets = _exclusive_cumsum(send_sizes)
  output_offsets = _exclusive_cumsum(sizes, axis=0)[me]  # where my chunk lands at each dst
  recv_sizes = sizes[:, me]
  buf = jnp.zeros((ep_size * n, x_NL.shape[1]), x_NL.dtype)
  recv = a2a(x_NL[order], buf, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name="expert")
  # Received rows: per source, per local slot (sources in order). Regroup by local slot.
  seg_sizes = per_rank[:, me, :].reshape(-1)  # [(src, local slot)]
  rows = ep_size * n
  # Segment of each row = (number of segments starting at or before it) - 1; O(rows), no search.
  starts = jnp.minimum(_exclusive_cumsum(seg_sizes), rows)
  seg_of_row = jnp.cumsum(jnp.bincount(starts, length=rows + 1))[:rows] - 1
  local_slot = jnp.where(jnp.arange(rows) < jnp.sum(seg_sizes), seg_of_row % s_loc, s_loc)
  regroup = jnp.argsort(local_slot, stable=True)
  group_sizes = jnp.sum(per_rank[:, me, :], axis=0)
  y_sorted = grouped_expert_mlp(recv[regroup], group_sizes, wg, wu, wd, cfg).astype(x_NL.dtype)
  y_recv = jnp.zeros_like(y_sorted).at[regroup].set(y_sorted)
  back = a2a(y_recv, jnp.zeros((n, y_recv.shape[1]), y_recv.dtype), _exclusive_cumsum(recv_sizes),
             recv_sizes, _exclusive_cumsum(sizes, axis=1)[:, me], send_sizes, axis_name="expert")
  y_N = jnp.zeros_like(back).at[order].set(back)
  return y_N, counts_S
