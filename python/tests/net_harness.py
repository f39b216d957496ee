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


def main():
    phases = sys.argv[1].split(",") if len(sys.argv) > 1 else ["forward", "backward", "any"]
    nbytes = int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 20
    name, net, _lib = load_like_nccl()
    wanted = os.environ.get("NCCL_NET")
    if wanted and net.name.decode().lower() != wanted.lower():
        raise RuntimeError(f"plugin is named {net.name.decode()!r}, NCCL_NET wants {wanted!r}")
    ok(net.init(None), "init")
    ndev = ctypes.c_int(0)
    ok(net.devices(ctypes.byref(ndev)), "devices")
    handle = ctypes.create_string_buffer(128)
    listen_comm, send_comm, recv_comm, dev_handle = P(), P(), P(), P()
    ok(net.listen(0, handle, ctypes.byref(listen_comm)), "listen")
    deadline = time.monotonic() + 30
    while not (send_comm.value and recv_comm.value):
        if not send_comm.value:
            ok(net.connect(0, handle, ctypes.byref(send_comm), ctypes.byref(dev_handle)), "connect")
        if not recv_comm.value:
            ok(net.accept(listen_comm, ctypes.byref(recv_comm), ctypes.byref(dev_handle)), "accept")
        if time.monotonic() > deadline:
            raise TimeoutError("connect/accept did not complete")
    send_buf = (ctypes.c_uint8 * nbytes)(*([i % 251 for i in range(nbytes)]))
    recv_buf = (ctypes.c_uint8 * nbytes)()
    smh, rmh = P(), P()
    ok(net.regMr(send_comm, send_buf, nbytes, NCCL_PTR_HOST, ctypes.byref(smh)), "regMr send")
    ok(net.regMr(recv_comm, recv_buf, nbytes, NCCL_PTR_HOST, ctypes.byref(rmh)), "regMr recv")
    intact = []
    for tag, phase in enumerate(phases):
        nccl_lossy.set_phase(phase)  # through the control API, on the copy loaded above
        ctypes.memset(recv_buf, 0xEE, nbytes)
        rreq, sreq = P(), P()
        data, sizes, tags = (P * 1)(ctypes.addressof(recv_buf)), (ctypes.c_int * 1)(nbytes), (ctypes.c_int * 1)(tag)
        mhs = (P * 1)(rmh.value)
        while not rreq.value:
            ok(net.irecv(recv_comm, 1, data, sizes, tags, mhs, ctypes.byref(rreq)), "irecv")
        while not sreq.value:
            ok(net.isend(send_comm, send_buf, nbytes, tag, smh, ctypes.byref(sreq)), "isend")
        deadline = time.monotonic() + 30
        wait(net, sreq, deadline)
        got = wait(net, rreq, deadline)
        intact.append(got == nbytes and bytes(recv_buf) == bytes(send_buf))
    live = nccl_lossy.stats()
    ok(net.deregMr(send_comm, smh), "deregMr")
    ok(net.deregMr(recv_comm, rmh), "deregMr")
    ok(net.closeSend(send_comm), "closeSend")  # writes the statistics file
    ok(net.closeRecv(recv_comm), "closeRecv")
    ok(net.closeListen(listen_comm), "closeListen")
    control = nccl_lossy.control.control()
    print(
        json.dumps(
            {
                "loaded": name,
                "plugin_name": net.name.decode(),
                "devices": ndev.value,
                "intact": intact,
                "live_stats": live,
                "control_source": control.source,
                "control_path": control.path,
            }
        )
    )


if __name__ == "__main__":
    main()
