"""Which local address the pipeline's own connections use (see :mod:`.pipeline_channel`).

The order, first match wins:

1. ``PIPESGD_CHANNEL_IFACE``: an interface name (``eth0``), for when the default is wrong;
2. ``HOROVOD_GLOO_IFACE``: the interface ``horovodrun --gloo`` chose for Horovod's own traffic;
3. every rank on one host (Horovod's local size equals its size): ``127.0.0.1``;
4. the address of the machine's host name, which is also what Horovod 0.28's Gloo context binds
   to for process sets (tools/cluster/README.md); on a cluster whose host names resolve to loopback
   this fails with an error that names ``PIPESGD_CHANNEL_IFACE``.
"""
from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from typing import Mapping, Optional

_SIOCGIFADDR = 0x8915  # Linux ioctl: the IPv4 address of an interface


def interface_address(iface: str) -> str:
    """The IPv4 address of interface ``iface`` (Linux)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", iface.encode()[:15]))
        except OSError as exc:
            raise RuntimeError(f"interface {iface!r} has no IPv4 address here ({exc.strerror}); set "
                               "PIPESGD_CHANNEL_IFACE to an interface that reaches the other hosts") from None
    return socket.inet_ntoa(packed[20:24])


def host_name_address() -> str:
    """The address the host name resolves to, as Horovod's Gloo context binds to."""
    name = socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError as exc:
        raise RuntimeError(f"the host name {name!r} does not resolve ({exc}); set PIPESGD_CHANNEL_IFACE to the "
                           "interface that reaches the other hosts") from None


def channel_address(single_host: bool, env: Optional[Mapping[str, str]] = None) -> str:
    """This rank's address for the pipeline's connections (the order is in the module docstring).

    ``single_host``: every rank of the job runs on this machine."""
    env = os.environ if env is None else env
    for variable in ("PIPESGD_CHANNEL_IFACE", "HOROVOD_GLOO_IFACE"):
        iface = env.get(variable, "").strip()
        if iface:
            return interface_address(iface)
    if single_host:
        return "127.0.0.1"
    address = host_name_address()
    if ipaddress.ip_address(address).is_loopback:
        raise RuntimeError(f"the host name {socket.gethostname()!r} resolves to {address}, a loopback address, "
                           "but the ranks run on several hosts; set PIPESGD_CHANNEL_IFACE to the interface "
                           "that reaches them (as HOROVOD_GLOO_IFACE / horovodrun --network-interface does "
                           "for Horovod)")
    return address
