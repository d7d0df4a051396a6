"""Framed pickle messages (+ optional fds) over a unix stream socket: 8-byte length, then the payload."""
import io
import pickle
import select
import socket
import struct


class _PlainUnpickler(pickle.Unpickler):
  """Sandbox-side processes may be compromised: only plain data (no classes/callables) is ever unpickled."""

  def find_class(self, module, name):
    raise pickle.UnpicklingError(f"refusing to unpickle global {module}.{name}")

_HDR = struct.Struct("<Q")


def loads(data: bytes):
  """Unpickle plain data (see _PlainUnpickler)."""
  return _PlainUnpickler(io.BytesIO(data)).load()


def send(sock: socket.socket, obj, fds=()) -> None:
  data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
  buf = _HDR.pack(len(data)) + data
  if fds:
    n = socket.send_fds(sock, [buf], list(fds))
    buf = buf[n:]
  if buf:
    sock.sendall(buf)


def _recv_exact(sock, n, first=b""):
  chunks, got = [first], len(first)
  while got < n:
    c = sock.recv(min(n - got, 1 << 20))
    if not c:
      raise EOFError("peer closed")
    chunks.append(c)
    got += len(c)
  return b"".join(chunks)


def recv(sock: socket.socket, with_fds: bool = False):
  """Returns obj, or (obj, fds) when with_fds (fds may only ride on the message's first bytes)."""
  fds = []
  if with_fds:
    head, fds, _, _ = socket.recv_fds(sock, _HDR.size, 16)
    if not head:
      raise EOFError("peer closed")
    head = _recv_exact(sock, _HDR.size, head)
  else:
    head = _recv_exact(sock, _HDR.size)
  (n,) = _HDR.unpack(head)
  obj = loads(_recv_exact(sock, n))
  return (obj, fds) if with_fds else obj


def requests(ctl: socket.socket, lifeline: int):
  """A helper process's requests (message, fds) on ctl, until the hub's lifeline breaks or ctl closes."""
  poller = select.poll()
  poller.register(ctl.fileno(), select.POLLIN)
  poller.register(lifeline, select.POLLIN)
  while True:
    for fd, _ in poller.poll():
      if fd == lifeline:
        return
      try:
        yield recv(ctl, with_fds=True)
      except (EOFError, OSError):
        return
