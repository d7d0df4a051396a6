"""launch/profile_train.py's attribution: nested trace events give self time; op_name -> component."""
import gzip
import json

from launch import profile_train as pt


def test_self_times_subtract_nested_events(tmp_path):
  meta = [dict(ph="M", name="thread_name", pid=1, tid=t, args=dict(name=n))
          for t, n in ((1, "tf_XLAEigen/1"), (2, "python"))]
  xs = [dict(ph="X", pid=1, tid=1, name="outer", ts=0, dur=100),
        dict(ph="X", pid=1, tid=1, name="dot.1", ts=10, dur=30),
        dict(ph="X", pid=1, tid=1, name="fusion.2", ts=50, dur=20),
        dict(ph="X", pid=1, tid=1, name="dot.1", ts=200, dur=5),
        dict(ph="X", pid=1, tid=2, name="python_only", ts=0, dur=999)]  # not an XLA thread
  f = tmp_path / "x.trace.json.gz"
  with gzip.open(f, "wt") as fh:
    json.dump({"traceEvents": meta + xs}, fh)
  st = pt.self_times(str(f))
  assert st == {"outer": 50, "dot.1": 35, "fusion.2": 20}


def test_component_and_hlo_names():
  hlo = ('  %dot.7 = f32[4,4]{1,0} dot(%a, %b), metadata={op_name="jit(step)/jvp(Transformer)/'
         'layers_1_3/layer_0/mixer/kda/dot_general"}\n'
         '  ROOT %fusion.3 = f32[8]{0} fusion(%c), kind=kLoop, calls=%fc\n')
  names = pt.hlo_op_names(hlo)
  assert names == {"dot.7": "jit(step)/jvp(Transformer)/layers_1_3/layer_0/mixer/kda/dot_general",
                   "fusion.3": ""}
  assert pt.component(names["dot.7"]) == "KDA mixer"
  assert pt.component("jit(step)/transpose(jvp(Transformer))/layer_2/ffn/moe/shared/dot") == "MoE shared expert"
  assert pt.component("jit(step)/transpose(jvp(Transformer))/layer_2/ffn/moe/top_k") == \
      "MoE routed (router, dispatch, experts)"
  assert pt.component("jit(step)/sqrt") == "optimizer + step bookkeeping"
  assert pt.component("").startswith("unattributed")
