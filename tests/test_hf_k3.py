"""K3 hub import: a tiny checkpoint in the released moonshotai/Kimi-K3 layout, written here by hand
(every tensor name listed in issue #26, MXFP4 experts, sharded, vision and MTP tensors present) ->
our model, whose logits must equal an independent NumPy forward of the K3 decoder (NeMo-AutoModel's
kimi_k3 layer order and AttnRes) run on the dequantised tensors; bad checkpoints; export round trip."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

safetensors_numpy = pytest.importorskip("safetensors.numpy")

from moonshot_jax.config import ConfigError, ModelConfig  # noqa: E402
from moonshot_jax.inference import hf_k3, hub_stream  # noqa: E402
from moonshot_jax.layers import mxfp4  # noqa: E402
from moonshot_jax.model.transformer import Transformer  # noqa: E402

BF16 = ml_dtypes.bfloat16
LIN = dict(num_heads=2, head_dim=16, short_conv_kernel_size=4, kda_layers=[1, 2, 3], full_attn_layers=[4],
           use_full_rank_gate=True, gate_lower_bound=-5.0)
TEXT = dict(model_type="kimi_linear", vocab_size=96, hidden_size=64, intermediate_size=48, num_hidden_layers=4,
            num_attention_heads=2, num_key_value_heads=2, hidden_act="situ", rms_norm_eps=1e-5,
            tie_word_embeddings=False, max_position_embeddings=256, moe_intermediate_size=32,
            num_experts=4, num_experts_per_token=2, num_shared_experts=1, routed_scaling_factor=1.5,
            moe_renormalize=True, moe_router_activation_func="sigmoid", first_k_dense_replace=1,
            moe_layer_freq=1, num_expert_group=1, topk_group=1, topk_method="noaux_tc",
            routed_expert_hidden_size=32, latent_moe_use_norm=True, q_lora_rank=24, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, mla_use_nope=True, mla_use_output_gate=True,
            linear_attn_config=LIN, attn_res_block_size=2, activation_situ_beta=4.0,
            activation_situ_linear_beta=25.0, num_nextn_predict_layers=1, kda_mode="chunk", bos_token_id=1)
VISION = dict(patch_size=14, vt_hidden_size=32, vt_num_hidden_layers=1)
TOP = dict(model_type="kimi_k3", architectures=["KimiK3ForConditionalGeneration"], text_config=TEXT,
           vision_config=VISION, media_placeholder_token_id=163605)


def model_cfg(**kw) -> ModelConfig:
  return ModelConfig(**hf_k3.architecture(TEXT), **kw)


def _mx_weight(rng, out, inn):
  """Random MXFP4 weight [out, in]: each block holds a code 6 or 7 (so its bytes are canonical)."""
  codes = rng.integers(0, 16, size=(out, inn), dtype=np.uint8)
  codes[:, ::32] = rng.choice(np.array([6, 7, 14, 15], np.uint8), size=(out, inn // 32))
  return mxfp4.pack_codes_np(codes), rng.integers(121, 124, size=(out, inn // 32), dtype=np.uint8)


def synthetic_k3(rng) -> dict[str, np.ndarray]:
  """Every tensor of the K3 layout, names and shapes written out from the released checkpoint."""
  c = TEXT
  D, V, H, K, W = c["hidden_size"], c["vocab_size"], LIN["num_heads"], LIN["head_dim"], LIN["short_conv_kernel_size"]
  Hm, N, R, Vm, L, Q = (c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"],
                        c["kv_lora_rank"], c["q_lora_rank"])
  E, F, lat = c["num_experts"], c["moe_intermediate_size"], c["routed_expert_hidden_size"]
  w = lambda *s, scale=0.2: (scale * rng.normal(size=s)).astype(BF16)
  ones = lambda n: (1 + 0.1 * rng.normal(size=n)).astype(BF16)
  t = {"language_model.model.embed_tokens.weight": w(V, D, scale=1.0),
       "language_model.model.norm.weight": ones(D), "language_model.lm_head.weight": w(V, D),
       "language_model.model.output_attn_res_norm.weight": ones(D),
       "language_model.model.output_attn_res_proj.weight": w(1, D, scale=1.0),
       "vision_tower.patch_embed.proj.weight": w(32, 3, 14, 14), "mm_projector.proj.0.weight": w(D, 128),
       "language_model.model.layers.4.eh_proj.weight": w(D, 2 * D)}  # an MTP layer: skipped by name
  for i in range(c["num_hidden_layers"]):
    p = f"language_model.model.layers.{i}."
    for n in ("self_attention_res_norm", "mlp_res_norm", "input_layernorm", "post_attention_layernorm"):
      t[p + n + ".weight"] = ones(D)
    t[p + "self_attention_res_proj.weight"], t[p + "mlp_res_proj.weight"] = w(1, D, scale=1.0), w(1, D, scale=1.0)
    a = p + "self_attn."
    if i + 1 in LIN["kda_layers"]:
      for n in "qkv":
        t[f"{a}{n}_proj.weight"] = w(H * K, D)
        t[f"{a}{n}_conv1d.weight"] = (0.5 * rng.normal(size=(H * K, 1, W))).astype(np.float32)
      t[a + "f_a_proj.weight"], t[a + "f_b_proj.weight"] = w(K, D), w(H * K, K)
      t[a + "A_log"] = np.concatenate([np.log(rng.uniform(1, 16, H)), np.zeros(128 - H)]).astype(np.float32)
      t[a + "dt_bias"] = (rng.normal(size=H * K)).astype(np.float32)
      t[a + "b_proj.weight"], t[a + "g_proj.weight"] = w(H, D), w(H * K, D)
      t[a + "o_norm.weight"], t[a + "o_proj.weight"] = ones(K), w(D, H * K)
    else:
      t[a + "q_a_proj.weight"], t[a + "q_a_layernorm.weight"] = w(Q, D), ones(Q)
      t[a + "q_b_proj.weight"] = w(Hm * (N + R), Q)
      t[a + "kv_a_proj_with_mqa.weight"], t[a + "kv_a_layernorm.weight"] = w(L + R, D), ones(L)
      t[a + "kv_b_proj.weight"], t[a + "o_proj.weight"] = w(Hm * (N + Vm), L), w(D, Hm * Vm)
      t[a + "g_proj.weight"] = w(Hm * Vm, D)
    if i < c["first_k_dense_replace"]:
      for n, s in (("gate_proj", (48, D)), ("up_proj", (48, D)), ("down_proj", (D, 48))):
        t[f"{p}mlp.{n}.weight"] = w(*s)
    else:
      m = p + "block_sparse_moe."
      t[m + "gate.weight"] = w(E, D, scale=1.0)
      t[m + "gate.e_score_correction_bias"] = (0.3 * rng.normal(size=E)).astype(np.float32)
      t[m + "routed_expert_down_proj.weight"], t[m + "routed_expert_up_proj.weight"] = w(lat, D), w(D, lat)
      t[m + "routed_expert_norm.weight"] = ones(lat)
      for j in range(E):
        for n, (o, inn) in (("w1", (F, lat)), ("w3", (F, lat)), ("w2", (lat, F))):
          t[f"{m}experts.{j}.{n}.weight_packed"], t[f"{m}experts.{j}.{n}.weight_scale"] = _mx_weight(rng, o, inn)
      for n, s in (("gate_proj", (F, D)), ("up_proj", (F, D)), ("down_proj", (D, F))):
        t[f"{m}shared_experts.{n}.weight"] = w(*s)
  return t


def write_checkpoint(d, tensors, config=TOP, n_shards=3):
  d.mkdir(parents=True, exist_ok=True)
  (d / "config.json").write_text(json.dumps(config))
  names = sorted(tensors)
  weight_map = {}
  for k in range(n_shards):
    part = names[k::n_shards]
    f = f"model-{k + 1:05d}-of-{n_shards:05d}.safetensors"
    safetensors_numpy.save_file({n: tensors[n] for n in part}, str(d / f))
    weight_map.update({n: f for n in part})
  (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  return d


# ---- independent NumPy forward of the K3 decoder (float64, on the dequantised hub tensors) ---------
def _rms(x, w, eps):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _sig(x):
  return 1 / (1 + np.exp(-x))


def _situ(g, u, c):
  b, bl = c["activation_situ_beta"], c["activation_situ_linear_beta"]
  return b * np.tanh(g / b) * _sig(g) * bl * np.tanh(u / bl)


def _mlp(x, t, p, c):
  return _situ(x @ t[p + "gate_proj.weight"].T, x @ t[p + "up_proj.weight"].T, c) @ t[p + "down_proj.weight"].T


def _kda(x, t, a, c):
  H, K, W = LIN["num_heads"], LIN["head_dim"], LIN["short_conv_kernel_size"]
  T = x.shape[0]

  def conv(z, name):
    w = t[f"{a}{name}.weight"][:, 0, :]  # [C, W], tap W-1 on the current token
    zp = np.concatenate([np.zeros((W - 1, z.shape[1])), z])
    y = np.stack([(zp[s:s + W] * w.T).sum(0) for s in range(T)])
    return y * _sig(y)

  l2 = lambda z: z / np.sqrt((z * z).sum(-1, keepdims=True) + 1e-6)
  q = l2(conv(x @ t[a + "q_proj.weight"].T, "q_conv1d").reshape(T, H, K))
  k = l2(conv(x @ t[a + "k_proj.weight"].T, "k_conv1d").reshape(T, H, K))
  v = conv(x @ t[a + "v_proj.weight"].T, "v_conv1d").reshape(T, H, K)
  f = (x @ t[a + "f_a_proj.weight"].T) @ t[a + "f_b_proj.weight"].T + t[a + "dt_bias"]
  g = LIN["gate_lower_bound"] * _sig(np.exp(t[a + "A_log"][:H])[:, None] * f.reshape(T, H, K))
  beta = _sig(x @ t[a + "b_proj.weight"].T)
  S, o = np.zeros((H, K, K)), np.zeros((T, H, K))
  for s in range(T):
    for h in range(H):
      Sh = np.exp(g[s, h])[:, None] * S[h]
      S[h] = Sh + beta[s, h] * np.outer(k[s, h], v[s, h] - Sh.T @ k[s, h])
      o[s, h] = S[h].T @ q[s, h] / np.sqrt(K)
  gate = (x @ t[a + "g_proj.weight"].T).reshape(T, H, K)
  o = _rms(o, t[a + "o_norm.weight"], c["rms_norm_eps"]) * _sig(gate)
  return o.reshape(T, -1) @ t[a + "o_proj.weight"].T


def _mla(x, t, a, c):
  T, eps = x.shape[0], c["rms_norm_eps"]
  H, N, R, V, L = (c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"],
                   c["kv_lora_rank"])
  q = (_rms(x @ t[a + "q_a_proj.weight"].T, t[a + "q_a_layernorm.weight"], eps) @ t[a + "q_b_proj.weight"].T)
  q = q.reshape(T, H, N + R)
  kva = x @ t[a + "kv_a_proj_with_mqa.weight"].T
  kv = (_rms(kva[:, :L], t[a + "kv_a_layernorm.weight"], eps) @ t[a + "kv_b_proj.weight"].T).reshape(T, H, N + V)
  k = np.concatenate([kv[..., :N], np.broadcast_to(kva[:, None, L:], (T, H, R))], -1)
  s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(N + R)
  s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  o = np.einsum("hqk,khv->qhv", p, kv[..., N:]).reshape(T, -1) * _sig(x @ t[a + "g_proj.weight"].T)
  return o @ t[a + "o_proj.weight"].T


def _moe(x, t, m, c):
  scores = _sig(x @ t[m + "gate.weight"].T)
  biased = scores + t[m + "gate.e_score_correction_bias"]
  z = x @ t[m + "routed_expert_down_proj.weight"].T
  routed = np.zeros_like(z)
  for s in range(x.shape[0]):
    idx = np.argsort(-biased[s], kind="stable")[:c["num_experts_per_token"]]
    wts = scores[s, idx] / scores[s, idx].sum() * c["routed_scaling_factor"]
    for j, wj in zip(idx, wts):
      e = f"{m}experts.{j}."
      routed[s] += wj * _situ(z[s] @ t[e + "w1.weight"].T, z[s] @ t[e + "w3.weight"].T, c) @ t[e + "w2.weight"].T
  routed = _rms(routed, t[m + "routed_expert_norm.weight"], c["rms_norm_eps"])
  return routed @ t[m + "routed_expert_up_proj.weight"].T + _mlp(x, t, m + "shared_experts.", c)


def _attn_res(prefix, blocks, t, name, eps):
  vals = np.stack(blocks + [prefix])  # [n, T, D]
  keys = vals / np.sqrt(np.mean(vals * vals, -1, keepdims=True) + eps)
  score = np.sum(keys * (t[name + "_res_norm.weight"] * t[name + "_res_proj.weight"][0]), -1)
  p = np.exp(score - score.max(0))
  return np.einsum("nt,ntd->td", p / p.sum(0), vals)


def k3_reference_logits(tokens, t, c):
  """The K3 decoder with block attention residuals exactly as the ports run it."""
  eps, bs = c["rms_norm_eps"], c["attn_res_block_size"]
  h, blocks = t["language_model.model.embed_tokens.weight"][tokens], []
  for i in range(c["num_hidden_layers"]):
    p = f"language_model.model.layers.{i}."
    prefix = h
    x = _attn_res(prefix, blocks, t, p + "self_attention", eps) if blocks else prefix
    if i % bs == 0:
      blocks, prefix = blocks + [prefix], None
    mix = _kda if i + 1 in LIN["kda_layers"] else _mla
    a = mix(_rms(x, t[p + "input_layernorm.weight"], eps), t, p + "self_attn.", c)
    prefix = a if prefix is None else prefix + a
    m_in = _rms(_attn_res(prefix, blocks, t, p + "mlp", eps), t[p + "post_attention_layernorm.weight"], eps)
    h = prefix + (_mlp(m_in, t, p + "mlp.", c) if i < c["first_k_dense_replace"]
                  else _moe(m_in, t, p + "block_sparse_moe.", c))
  final = _attn_res(h, blocks, t, "language_model.model.output_attn", eps)
  return _rms(final, t["language_model.model.norm.weight"], eps) @ t["language_model.lm_head.weight"].T


def dequantised64(tensors):
  out = {}
  for k, v in tensors.items():
    if k.endswith(".weight_packed"):
      base = k[:-len("_packed")]
      out[base] = mxfp4.dequantize_np(v, tensors[base + "_scale"], np.float64)
    elif not k.endswith(".weight_scale"):
      out[k] = np.asarray(v, np.float64)
  return out


# ---- tests -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  tensors = synthetic_k3(np.random.default_rng(0))
  return write_checkpoint(tmp_path_factory.mktemp("k3_tiny"), tensors), tensors


def test_config_mapping_and_errors():
  arch = hf_k3.architecture(TEXT)
  cfg = ModelConfig(**arch)
  assert cfg.layer_kinds == (("kda", "dense"), ("kda", "moe"), ("kda", "moe"), ("mla", "moe"))
  assert cfg.kda_output_gate_full_rank and cfg.kda_gate_lower_bound == -5.0 and cfg.mla_output_gate
  assert (cfg.moe_latent_dim, cfg.shared_ff_dim, cfg.q_lora_rank, cfg.attn_res_block_size) == (32, 32, 24, 2)
  assert (cfg.expert_activation, cfg.dense_activation, cfg.norm_eps) == ("situ", "situ", 1e-5)
  text, vision = hf_k3.split_config(TOP)
  assert vision == VISION and text == TEXT
  for bad, key in ((dict(TEXT, surprise_key=1), "surprise_key"), (dict(TEXT, hidden_act="silu"), "hidden_act"),
                   (dict(TEXT, num_expert_group=8), "num_expert_group"),
                   (dict(TEXT, linear_attn_config=dict(LIN, new_gate=True)), "new_gate")):
    with pytest.raises(ConfigError, match=key):
      hf_k3.architecture(bad)
  with pytest.raises(ConfigError, match="weird_top"):
    hf_k3.split_config(dict(TOP, weird_top=1))
  with pytest.raises(ConfigError, match="kda_num_heads: checkpoint 2"):
    hf_k3.check_against(cfg.replace(kda_num_heads=1, kda_num_v_heads=1), arch)
  # export writes a text_config that maps back to the same architecture
  assert hf_k3.architecture(hf_k3.text_config_for(cfg, True)) == {**arch}


def test_import_matches_independent_reference(ckpt):
  d, tensors = ckpt
  cfg = model_cfg()
  hub = hub_stream.HubDir(d)
  report = hub_stream.validate(hub, cfg)
  assert report["experts_mxfp4"]
  assert report["skipped"] == {"vision": ["mm_projector.proj.0.weight", "vision_tower.patch_embed.proj.weight"],
                               "mtp": ["language_model.model.layers.4.eh_proj.weight"]}
  variables = hub_stream.load_variables(hub, cfg, report=report, progress=False)
  tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(1, 10)).astype(np.int32)
  ref = k3_reference_logits(tokens[0], dequantised64(tensors), TEXT)
  ours, _ = jax.jit(Transformer(cfg).apply)(variables, jnp.asarray(tokens))
  ours = np.asarray(ours[0], np.float64)
  assert np.max(np.abs(ours - ref)) / np.max(np.abs(ref)) < 2e-4
  # the experts are the exact MXFP4 values (in fp32 master weights); layer 1 is repeat 0 of the scan
  e = "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight"
  w_down = np.asarray(variables["params"]["layers_1_3"]["layer_0"]["ffn"]["moe"]["w_down"][0, 3])
  np.testing.assert_array_equal(w_down, mxfp4.dequantize_np(tensors[e + "_packed"], tensors[e + "_scale"]).T)


def test_sharded_import_reads_only_its_slices(ckpt):
  """Experts sharded over 4 devices: every shard equals the unsharded import, and the callbacks
  for one device read only the expert tensors of its experts."""
  d, _ = ckpt
  cfg = model_cfg()
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  mesh = Mesh(np.array(jax.devices()[:4]), ("expert",))
  hub = hub_stream.HubDir(d)
  want = hub_stream.load_variables(hub, cfg, progress=False)
  reads = []
  orig = hub.read
  hub.read = lambda name: (reads.append(name), orig(name))[1]

  def spec(path, x):
    leaf = str(getattr(path[-1], "key", path[-1]))
    scanned = str(getattr(path[1], "key", "")).startswith("layers_")
    if leaf in ("w_gate", "w_up", "w_down"):
      return NamedSharding(mesh, P(*((None, "expert") if scanned else ("expert",))))
    return NamedSharding(mesh, P())

  shardings = jax.tree_util.tree_map_with_path(spec, want)
  got = hub_stream.load_variables(hub, cfg, shardings=shardings, progress=False)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  w = got["params"]["layers_1_3"]["layer_0"]["ffn"]["moe"]["w_gate"]  # [2 repeats, E=4, l, F]
  assert {tuple(s.data.shape) for s in w.addressable_shards} == {(2, 1, 32, 32)}
  expert_reads = [n for n in reads if ".experts." in n and ".w1." in n]
  # each of the 4 devices reads its own expert of each layer once: 4 experts x 3 MoE layers x (packed, scale)
  assert sorted(expert_reads) == sorted(set(expert_reads)) and len(expert_reads) == 4 * 3 * 2


def _rewrite(tmp_path, tensors, name="bad", **kw):
  return write_checkpoint(tmp_path / name, tensors, **kw)


def test_bad_checkpoints_are_named(ckpt, tmp_path):
  _, tensors = ckpt
  cfg = model_cfg()
  cases = {
      "missing": ({k: v for k, v in tensors.items() if k != "language_model.model.layers.2.self_attn.g_proj.weight"},
                  "layers.2.self_attn.g_proj.weight"),
      "extra": (dict(tensors, **{"language_model.model.layers.0.self_attn.surprise": np.zeros(2, np.float32)}),
                "surprise"),
      "shape": (dict(tensors, **{"language_model.model.norm.weight": np.zeros(7, BF16)}), "model.norm.weight"),
      "dtype": (dict(tensors, **{"language_model.model.layers.3.block_sparse_moe.experts.1.w3.weight_packed":
                                 np.zeros((32, 16), np.float32)}), "experts.1.w3.weight_packed"),
  }
  for case, (t, culprit) in cases.items():
    d = _rewrite(tmp_path, t, case)
    with pytest.raises(ValueError, match=culprit.replace(".", r"\.")):
      hub_stream.validate(hub_stream.HubDir(d), cfg)
  # corrupt MXFP4 scale (0xFF = NaN) is caught when read, naming the tensor
  s = "language_model.model.layers.2.block_sparse_moe.experts.0.w1.weight_scale"
  bad = dict(tensors, **{s: np.full_like(tensors[s], 255)})
  hub = hub_stream.HubDir(_rewrite(tmp_path, bad, "nan_scale"))
  with pytest.raises(ValueError, match=s.replace(".", r"\.")):
    hub_stream.load_variables(hub, cfg, progress=False)
  # a truncated shard: named, before anything is read
  d = _rewrite(tmp_path, tensors, "truncated")
  f = sorted(d.glob("*.safetensors"))[1]
  f.write_bytes(f.read_bytes()[:-100])
  with pytest.raises(ValueError, match=f.name):
    hub_stream.HubDir(d)
  # the index pointing at the wrong file
  d = _rewrite(tmp_path, tensors, "index")
  idx = json.loads((d / "model.safetensors.index.json").read_text())
  idx["weight_map"]["language_model.lm_head.weight"] = "model-00009-of-00009.safetensors"
  (d / "model.safetensors.index.json").write_text(json.dumps(idx))
  with pytest.raises(ValueError, match="lm_head"):
    hub_stream.HubDir(d)


@pytest.mark.parametrize("experts_mxfp4", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["mxfp4", "bf16"])
def test_export_import_round_trip_is_bit_exact(ckpt, tmp_path, experts_mxfp4, monkeypatch):
  d, tensors = ckpt
  cfg = model_cfg()
  first = hub_stream.load_variables(hub_stream.HubDir(d), cfg, progress=False)
  out = tmp_path / "export"
  gathered, to_host = [], hub_stream._to_host
  monkeypatch.setattr(hub_stream, "_to_host", lambda x: gathered.append(to_host(x)) or gathered[-1])
  info = hub_stream.write_hub(first, cfg, out, experts_mxfp4=experts_mxfp4, max_shard_bytes=200_000,
                              vision_config=VISION, progress=False)
  assert info["files"] > 1
  # the export brings one piece (one expert's matrix, one layer's leaf) to the host at a time, in order
  pcs = [pc for pc in hf_k3.pieces(cfg, experts_mxfp4)]
  assert [tuple(g.shape) for g in gathered] == [tuple(pc.shape) for pc in pcs]
  hub2 = hub_stream.HubDir(out)
  assert hf_k3.split_config(hub2.config)[1] == VISION
  hf_k3.check_against(cfg, hf_k3.architecture(hf_k3.split_config(hub2.config)[0]))
  second = hub_stream.load_variables(hub2, cfg, progress=False)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(first), jax.tree.leaves(second)):
    assert np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(path)
  if experts_mxfp4:  # canonical MXFP4 blocks come back as the same bytes
    for name in (n for n in tensors if n.endswith(("_packed", "_scale"))):
      np.testing.assert_array_equal(hub2.read(name), tensors[name])
    for name in (n for n in tensors if n.endswith(".weight") and n.startswith("language_model.model.layers.0.mlp.")):
      np.testing.assert_array_equal(hub2.read(name), tensors[name])
  with pytest.raises(ValueError, match="already exists"):
    hub_stream.write_hub(first, cfg, out, progress=False)
