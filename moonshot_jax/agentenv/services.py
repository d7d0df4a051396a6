"""Built-in service sources for Sandbox.start_service (each defines handle(request: str) -> str)."""

KV = r'''
"""Key-value store. SET k v | GET k | DEL k | INCR k | KEYS | SIZE. Unknown key -> (nil)."""
store = {}

def handle(request):
  parts = request.strip().split(" ", 2)
  op = parts[0].upper() if parts else ""
  if op == "SET" and len(parts) == 3:
    store[parts[1]] = parts[2]
    return "OK"
  if op == "GET" and len(parts) == 2:
    return store.get(parts[1], "(nil)")
  if op == "DEL" and len(parts) == 2:
    return "1" if store.pop(parts[1], None) is not None else "0"
  if op == "INCR" and len(parts) == 2:
    store[parts[1]] = str(int(store.get(parts[1], "0")) + 1)
    return store[parts[1]]
  if op == "KEYS" and len(parts) == 1:
    return "\n".join(sorted(store))
  if op == "SIZE" and len(parts) == 1:
    return str(len(store))
  return "ERR usage: SET k v | GET k | DEL k | INCR k | KEYS | SIZE"
'''

REPL = r'''
"""Persistent Python namespace: each request is executed; the reply is what it printed (or the traceback)."""
import contextlib, io, traceback
env = {"__name__": "__repl__"}

def handle(code):
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
    try:
      try:
        result = eval(compile(code, "<repl>", "eval"), env)
        if result is not None:
          print(repr(result))
      except SyntaxError:
        exec(compile(code, "<repl>", "exec"), env)
    except BaseException:
      traceback.print_exc()
  return buf.getvalue()
'''
