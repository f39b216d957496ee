"""A small stand-in for NCCL's proxy, in Python: loads the net plugin the way NCCL does (from
``NCCL_NET_PLUGIN``, checking its name against ``NCCL_NET``) and moves messages through its
``ncclNetPlugin_v8`` table over loopback, one message per training phase.

Run as a script (in a fresh process, so the plugin's process-wide state starts clean); it
prints one JSON line with what it saw. Used by the tests only.
"""

import ctypes
import json
import os
import sys
import time

import nccl_lossy
from nccl_lossy._library import nccl_plugin_candidates

RES = ctypes.c_int
P = ctypes.c_void_p
PP = ctypes.POINTER(ctypes.c_void_p)
IP = ctypes.POINTER(ctypes.c_int)
F = ctypes.CFUNCTYPE
NCCL_PTR_HOST = 1


class NetV8(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("init", F(RES, P)),
        ("devices", F(RES, IP)),
        ("getProperties", F(RES, ctypes.c_int, P)),
        ("listen", F(RES, ctypes.c_int, P, PP)),
        ("connect", F(RES, ctypes.c_int, P, PP, PP)),
        ("accept", F(RES, P, PP, PP)),
        ("regMr", F(RES, P, P, ctypes.c_size_t, ctypes.c_int, PP)),
        ("regMrDmaBuf", P),
        ("deregMr", F(RES, P, P)),
        ("isend", F(RES, P, P, ctypes.c_int, ctypes.c_int, P, PP)),
        ("irecv", F(RES, P, ctypes.c_int, PP, IP, IP, PP, PP)),
        ("iflush", P),
        ("test", F(RES, P, IP, IP)),
        ("closeSend", F(RES, P)),
        ("closeRecv", F(RES, P)),
        ("closeListen", F(RES, P)),
        ("getDeviceMr", P),
        ("irecvConsumed", P),
    ]


def ok(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what} returned ncclResult {rc}")


def load_like_nccl():
    """dlopen the first candidate NCCL_NET_PLUGIN names that has a v8 table (as NCCL does)."""
    for name in nccl_plugin_candidates(os.environ.get("NCCL_NET_PLUGIN")):
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_NOW | os.RTLD_LOCAL)
        except OSError:
            continue
        try:
            return name, NetV8.in_dll(lib, "ncclNetPlugin_v8"), lib
        except ValueError:
            continue
    raise RuntimeError(f"no net plugin loadable from NCCL_NET_PLUGIN={os.environ.get('NCCL_NET_PLUGIN')}")


def wait(net, request, deadline):
    done, size = ctypes.c_int(0), ctypes.c_int(0)
    while True:
        ok(net.test(request, ctypes.byref(done), ctypes.byref(size)), "test")
        if done.value:
            return size.value
        if time.monotonic() > deadline:
            raise TimeoutError("request did not complete")


class Link:
    """One connection through the plugin's v8 table over loopback (send side and receive side
    in this process), with registered buffers of ``nbytes``."""

    def __init__(self, nbytes):
        self.name, self.net, self._lib = load_like_nccl()
        wanted = os.environ.get("NCCL_NET")
        if wanted and self.net.name.decode().lower() != wanted.lower():
            raise RuntimeError(f"plugin is named {self.net.name.decode()!r}, NCCL_NET wants {wanted!r}")
        net = self.net
        ok(net.init(None), "init")
        self.ndev = ctypes.c_int(0)
        ok(net.devices(ctypes.byref(self.ndev)), "devices")
        handle = ctypes.create_string_buffer(128)
        self.listen_comm, self.send_comm, self.recv_comm, dev_handle = P(), P(), P(), P()
        ok(net.listen(0, handle, ctypes.byref(self.listen_comm)), "listen")
        deadline = time.monotonic() + 30
        while not (self.send_comm.value and self.recv_comm.value):
            if not self.send_comm.value:
                ok(net.connect(0, handle, ctypes.byref(self.send_comm), ctypes.byref(dev_handle)), "connect")
            if not self.recv_comm.value:
                ok(net.accept(self.listen_comm, ctypes.byref(self.recv_comm), ctypes.byref(dev_handle)), "accept")
            if time.monotonic() > deadline:
                raise TimeoutError("connect/accept did not complete")
        self.nbytes = nbytes
        self.send_buf = (ctypes.c_uint8 * nbytes)(*([i % 251 for i in range(nbytes)]))
        self.recv_buf = (ctypes.c_uint8 * nbytes)()
        self.smh, self.rmh = P(), P()
        ok(net.regMr(self.send_comm, self.send_buf, nbytes, NCCL_PTR_HOST, ctypes.byref(self.smh)), "regMr send")
        ok(net.regMr(self.recv_comm, self.recv_buf, nbytes, NCCL_PTR_HOST, ctypes.byref(self.rmh)), "regMr recv")
        self.tag = 0

    def send(self):
        """Moves one message of ``nbytes``; returns whether it arrived intact."""
        net, nbytes = self.net, self.nbytes
        self.tag += 1
        ctypes.memset(self.recv_buf, 0xEE, nbytes)
        rreq, sreq = P(), P()
        data = (P * 1)(ctypes.addressof(self.recv_buf))
        sizes, tags = (ctypes.c_int * 1)(nbytes), (ctypes.c_int * 1)(self.tag)
        mhs = (P * 1)(self.rmh.value)
        while not rreq.value:
            ok(net.irecv(self.recv_comm, 1, data, sizes, tags, mhs, ctypes.byref(rreq)), "irecv")
        while not sreq.value:
            ok(net.isend(self.send_comm, self.send_buf, nbytes, self.tag, self.smh, ctypes.byref(sreq)), "isend")
        deadline = time.monotonic() + 30
        wait(net, sreq, deadline)
        got = wait(net, rreq, deadline)
        return got == nbytes and bytes(self.recv_buf) == bytes(self.send_buf)

    def close(self):
        """Closes the connection (the plugin writes its statistics file then)."""
        net = self.net
        ok(net.deregMr(self.send_comm, self.smh), "deregMr")
        ok(net.deregMr(self.recv_comm, self.rmh), "deregMr")
        ok(net.closeSend(self.send_comm), "closeSend")
        ok(net.closeRecv(self.recv_comm), "closeRecv")
        ok(net.closeListen(self.listen_comm), "closeListen")


def main():
    phases = sys.argv[1].split(",") if len(sys.argv) > 1 else ["forward", "backward", "any"]
    nbytes = int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 20
    link = Link(nbytes)
    intact = []
    for phase in phases:
        nccl_lossy.set_phase(phase)  # through the control API, on the copy loaded above
        intact.append(link.send())
    live = nccl_lossy.stats()
    link.close()
    control = nccl_lossy.control.control()
    print(
        json.dumps(
            {
                "loaded": link.name,
                "plugin_name": link.net.name.decode(),
                "devices": link.ndev.value,
                "intact": intact,
                "live_stats": live,
                "control_source": control.source,
                "control_path": control.path,
            }
        )
    )


if __name__ == "__main__":
    main()
