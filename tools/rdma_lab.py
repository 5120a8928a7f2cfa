#!/usr/bin/env python3
"""The RDMA lab: a QEMU guest running the kernel's Soft-RoCE (rxe) and Soft-iWARP (siw).

The project's own code is proven here against RDMA stacks nobody here wrote. The guest is
Debian 12's own kernel with a busybox initramfs that mounts this host's root read-only
over virtio-9p and chroots into it, so the guest runs exactly the host's programs
(rdma-core, perftest, tcpdump, this checkout and its .venv) without an image to build.
``siw`` is in no Debian kernel; it is compiled for the guest kernel from
``linux-source-6.1`` against ``linux-headers`` (about 10 s).

The guest has two NICs, tap devices in a network namespace of the lab's own on the host:
``eth0`` with ``rxe0`` (``10.99.0.1``; host side ``10.99.0.2``) and ``eth1`` with ``siw0``
(``10.99.1.1``; host side ``10.99.1.2``), one device per netdev because rdma_cm picks the
device by the address's netdev; both links carry 9000-octet frames. A veth pair inside the
guest (one end in its root namespace, the other in its namespace ``peer``) carries ``siw1``
and ``siw2`` (``10.97.0.1``, ``10.97.0.2``) for device-to-device runs. Two rxe devices in one
guest cannot reach each other (rxe 6.1 receives only in the initial network namespace, and
traffic between two local addresses goes through ``lo``, where no rxe device is); an rxe
device reaches its own address through rxe's loopback, which is how rxe runs
device-to-device here. Commands run in the guest through the QEMU guest agent
(``qemu-ga``) on a virtio-serial port; a directory of the host's, at the same path in the
guest (read-write), takes logs and captures.

KVM is unusable inside these machines (QEMU stops with "failed to set MSR 0x10a"; with
that MSR masked the guest kernel hangs at start), so the guest runs under TCG: it boots
in about 10 s, and runs Python about twenty times slower than the host.

    tools/rdma_lab.py build              install the Debian packages, build siw.ko and the initramfs
    tools/rdma_lab.py shell              boot and get a shell in the guest (exit: Ctrl-D)
    tools/rdma_lab.py run -- rdma link   boot, run one command in the guest, print its output
    tools/rdma_lab.py up                 boot and keep the guest up until Ctrl-C ...
    tools/rdma_lab.py exec -- CMD        ... and run commands in it from another terminal
    tools/rdma_lab.py exec --lab DIR --timeout 30 -- CMD
                                         ... in a lab another process booted (its DIR), the
                                         caller's KBTP_* variables passed on, killed in the
                                         guest after 30 s: how ``kbtp conform --role
                                         initiator`` on the host runs an initiator in the guest

Everything is idempotent and cached under ``.lab/`` of the checkout.
"""
from __future__ import annotations

import argparse
import base64
import contextlib
import glob
import gzip
import hashlib
import itertools
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".lab"
RUNNING = CACHE / "running.json"

#: Debian packages the lab needs on the host (the guest runs the same files).
#: The guest's kernel is not among them: a host without a Debian kernel gets one unpacked
#: under .lab/ (``unpack_kernel``), not a new boot kernel.
PACKAGES = ["qemu-system-x86", "qemu-guest-agent", "linux-headers-amd64",
            "linux-source-6.1", "busybox-static", "rdma-core", "ibverbs-providers",
            "ibverbs-utils", "rdmacm-utils", "perftest", "python3-pyverbs", "tcpdump",
            "iproute2", "kmod", "xz-utils", "make", "gcc", "cpio",
            "libibverbs-dev", "librdmacm-dev"]       # for examples/c-initiator

#: Modules the initramfs loads to reach the host's root; the rest comes from the host.
INITRAMFS_MODULES = ["virtio_pci", "9p", "9pnet_virtio"]
#: Modules loaded once the host's root is mounted (modprobe resolves their dependencies).
GUEST_MODULES = ["virtio_net", "virtio_console", "crc32_generic", "libcrc32c", "rdma_rxe",
                 "ib_uverbs", "rdma_ucm", "veth", "sch_netem", "af_packet", "ifb", "sch_ingress",
                 "cls_matchall", "act_mirred"]

#: (guest, host side) of the two links; rxe0 is on the first, siw0 on the second: rdma_cm
#: picks a device by the address's netdev, so two devices on one netdev cannot be told apart.
GUEST_IP, HOST_IP = "10.99.0.1", "10.99.0.2"
SIW_GUEST_IP, SIW_HOST_IP = "10.99.1.1", "10.99.1.2"
#: the guest's inner veth pair (root namespace, namespace "peer") with siw1 and siw2
SIW_INNER_IP, SIW_PEER_IP = "10.97.0.1", "10.97.0.2"
#: The lab's own networks: a target run in it trusts them with the direct modes (--trust).
NETWORKS = ("10.99.0.0/16", "10.97.0.0/16")
TRUST_ARGS = [arg for net in NETWORKS for arg in ("--trust", net)]
#: a second host-side address on the first link: a host initiator of a host target needs
#: an address of its own (RoCEv2 owns UDP 4791 per address)
HOST_IP2 = "10.99.0.3"
TAPS = [("kbtap0", (HOST_IP, HOST_IP2)), ("kbtap1", (SIW_HOST_IP,))]
#: jumbo frames on the links: rxe's path MTU 4096 (a 1500-octet link gives 1024; set eth0's
#: MTU to get it), siw's MULPDU from a 9000-octet link's MSS
MTU = 9000
GUEST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class LabError(Exception):
    """The lab cannot be built or booted here; the message says why and what to do."""


def log(msg: str) -> None:
    print(f"rdma_lab: {msg}", file=sys.stderr, flush=True)


# -- build ---------------------------------------------------------------------------------


@dataclass
class GuestKernel:
    kver: str
    vmlinuz: Path
    modules: Path                  # the folder holding KVER/ (/lib/modules when installed)


#: where ``unpack_kernel`` puts a kernel package's files (boot/, lib/modules/)
UNPACKED = CACHE / "kernel"


def _kernels(root: Path) -> list[GuestKernel]:
    """Debian kernels with rxe under ``root`` (/ for the installed ones), oldest first."""
    out = []
    for vmlinuz in sorted((root / "boot").glob("vmlinuz-*")):
        kver = vmlinuz.name.removeprefix("vmlinuz-")
        for modules in (root / "lib/modules", root / "usr/lib/modules"):
            if (modules / kver / "kernel/drivers/infiniband/sw/rxe").is_dir():
                out.append(GuestKernel(kver, vmlinuz, modules))
                break
    return out


def guest_kernel() -> GuestKernel:
    """The newest installed Debian kernel that has rxe, else the one unpacked under .lab/."""
    found = _kernels(Path("/")) or _kernels(UNPACKED)
    if not found:
        raise LabError("no Debian kernel with rdma_rxe here: run 'tools/rdma_lab.py build'")
    return found[-1]


def unpack_kernel() -> None:
    """The kernel package linux-image-amd64 names, unpacked under .lab/kernel with its
    modules' dependencies computed, and not installed: the host's boot kernel stays as it is."""
    if _kernels(Path("/")) or _kernels(UNPACKED):
        return
    depends = subprocess.run(["apt-cache", "depends", "linux-image-amd64"], capture_output=True,
                             text=True).stdout
    image = next((line.split(":", 1)[1].strip() for line in depends.splitlines()
                  if line.strip().startswith("Depends:") and "linux-image-" in line), None)
    if image is None:
        raise LabError("apt-cache knows no linux-image-amd64: run 'apt-get update' (Debian 12)")
    log(f"unpacking {image} into {UNPACKED} for the guest (not installed: the host's boot "
        "kernel is left alone)")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["apt-get", "download", "-qq", image], cwd=tmp, check=True)
        deb = next(Path(tmp).glob("*.deb"))
        UNPACKED.mkdir(parents=True, exist_ok=True)
        subprocess.run(["dpkg-deb", "-x", str(deb), str(UNPACKED)], check=True)
    for k in _kernels(UNPACKED):
        base = UNPACKED if k.modules == UNPACKED / "lib/modules" else UNPACKED / "usr"
        subprocess.run(["depmod", "-b", str(base), k.kver], check=True)


def missing_packages() -> list[str]:
    out = subprocess.run(["dpkg-query", "-W", "-f", "${Package} ${db:Status-Status}\n", *PACKAGES],
                         capture_output=True, text=True).stdout
    installed = {line.split()[0] for line in out.splitlines() if line.endswith(" installed")}
    return [p for p in PACKAGES if p not in installed]


def install_packages() -> None:
    missing = missing_packages()
    if not missing:
        return
    if os.geteuid() != 0:
        raise LabError(f"the lab needs Debian packages {' '.join(missing)}: run as root")
    log(f"installing {' '.join(missing)} from Debian's packages")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    lock = ["-o", "DPkg::Lock::Timeout=600"]       # another apt (unattended upgrades) may hold it
    subprocess.run(["apt-get", *lock, "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", *lock, "install", "-y", "-qq", "--no-install-recommends", *missing],
                   check=True, env=env, stdout=subprocess.DEVNULL)


@dataclass
class Artifacts:
    kver: str
    kernel: Path
    initramfs: Path
    siw: Path
    modules: Path                  # the guest's /lib/modules


def _stamp() -> str:
    """Rebuild when this script changes (the init scripts live in it)."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def build_siw(kver: str, out: Path) -> Path:
    siw = out / "siw.ko"
    if siw.exists():
        return siw
    sources = sorted(glob.glob("/usr/src/linux-source-*.tar.xz"))
    if not sources:
        raise LabError("linux-source-6.1 is not installed: run 'tools/rdma_lab.py build'")
    log("building siw.ko for the guest kernel (about 20 s)")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["tar", "-xJf", sources[-1], "-C", tmp, "--wildcards",
                        "*/drivers/infiniband/sw/siw/*"], check=True)
        src = next(Path(tmp).glob("*/drivers/infiniband/sw/siw"))
        done = subprocess.run(["make", "-s", "-C", f"/usr/src/linux-headers-{kver}", f"M={src}",
                               "CONFIG_RDMA_SIW=m", "modules"], capture_output=True, text=True)
        if done.returncode != 0 or not (src / "siw.ko").exists():
            raise LabError(f"building siw.ko failed: {done.stderr.strip()[-500:]}")
        shutil.copy(src / "siw.ko", siw)
    return siw


def _module_files(kernel: GuestKernel, names: list[str]) -> list[Path]:
    """The .ko files of ``names`` and their dependencies, dependencies first."""
    base = kernel.modules / kernel.kver
    deps: dict[str, list[str]] = {}
    for line in (base / "modules.dep").read_text().splitlines():
        path, _, rest = line.partition(":")
        deps[Path(path).name.split(".ko")[0].replace("-", "_")] = [path, *rest.split()]
    order: list[Path] = []

    def add(rel: str) -> None:
        mod = Path(rel).name.split(".ko")[0].replace("-", "_")
        for dep in deps[mod][:0:-1]:
            add(dep)
        if base / rel not in order:
            order.append(base / rel)

    for name in names:
        if name.replace("-", "_") in deps:
            add(deps[name.replace("-", "_")][0])
    return order


INIT = r"""#!/bin/busybox sh
# Stage 1 (initramfs): reach the host's root over virtio-9p, then chroot into it.
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for m in $(cat /modules.order); do insmod /modules/$m || echo "init: insmod $m failed"; done
mkdir -p /newroot
mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=512000 hostroot /newroot \
  || { echo "init: cannot mount the host's root"; poweroff -f; }
mount -t tmpfs -o mode=0755 run /newroot/run
cp /stage2.sh /newroot/run/stage2.sh
for d in proc sys dev; do mount --move /$d /newroot/$d; done
exec chroot /newroot /bin/sh /run/stage2.sh
"""

STAGE2 = r"""# Stage 2 (in the host's root, read-only): writable places, modules, RDMA devices, agent.
set -u
export PATH=@PATH@ HOME=/tmp/home
ulimit -l unlimited      # RDMA registrations pin memory: what every RDMA host configures
say() { echo "lab: $*" > /dev/ttyS0; }
mount -t devpts devpts /dev/pts 2>/dev/null
# The checkout's .venv as the host's root shows it (cached: fast imports), taken before the
# tmpfs below would hide a checkout under /tmp or /var/tmp.
mkdir -p /run/venv && mount --bind @ROOT@/.venv /run/venv || say "cannot mount the checkout's .venv"
for d in /tmp /var/tmp; do mount -t tmpfs tmp "$d" 2>/dev/null; done
mkdir -p /run/netns /run/lock /tmp/home @LAB@ @ROOT@
mount -t 9p -o trans=virtio,version=9p2000.L,cache=none,msize=512000 lab @LAB@ || say "no /lab"
# The checkout uncached (edits on the host show at once), with the cached .venv moved in.
mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=none,msize=512000 checkout @ROOT@ \
  && mount --move /run/venv @ROOT@/.venv || say "cannot mount the checkout"
# A guest kernel unpacked under .lab/ (none installed on the host): its modules.
[ "@MODROOT@" = /lib/modules ] || mount --bind @MODROOT@ /lib/modules \
  || say "cannot mount the guest kernel's modules"
modprobe -a @MODULES@ || say "modprobe failed"
insmod @SIW@ || say "insmod siw failed"
ip link set lo up
ip link set eth0 mtu @MTU@ up && ip addr add @GUEST_IP@/24 dev eth0
ip link set eth1 mtu @MTU@ up && ip addr add @SIW_GUEST_IP@/24 dev eth1
ip netns add peer && ip -n peer link set lo up
pair() {  # veth $1 (here, address $2) and $1p (namespace peer, address $3)
  ip link add $1 type veth peer name $1p && ip link set $1p netns peer
  ip link set $1 up && ip addr add $2/24 dev $1
  ip -n peer link set $1p up && ip -n peer addr add $3/24 dev $1p
}
pair vsiw @SIW_INNER_IP@ @SIW_PEER_IP@ || say "veth failed"
rdma link add rxe0 type rxe netdev eth0 || say "rxe0 failed"
rdma link add siw0 type siw netdev eth1 || say "siw0 failed"
rdma link add siw1 type siw netdev vsiw || say "siw1 failed"
ip netns exec peer rdma link add siw2 type siw netdev vsiwp || say "siw2 failed"
port=$(grep -l org.qemu.guest_agent.0 /sys/class/virtio-ports/*/name | head -1 | xargs dirname | xargs basename)
qemu-ga -m virtio-serial -p /dev/$port -t /run &
say "ready $(cut -d' ' -f1 /proc/uptime)"
if grep -q kbtp.shell=1 /proc/cmdline; then
  cd @ROOT@ 2>/dev/null
  setsid sh -c 'exec bash -i </dev/ttyS0 >/dev/ttyS0 2>&1'
  busybox poweroff -f
fi
while :; do wait; sleep 1; done
"""


def build(*, packages: bool = True) -> Artifacts:
    """Install what is missing and build what is stale; fast when all is there."""
    if packages:
        install_packages()
        unpack_kernel()
    kernel = guest_kernel()
    kver = kernel.kver
    out = CACHE / kver
    out.mkdir(parents=True, exist_ok=True)
    siw = build_siw(kver, out)
    initramfs = out / "initramfs.gz"
    stamp = out / "stamp"
    if not (initramfs.exists() and stamp.exists() and stamp.read_text() == _stamp()):
        log("building the initramfs")
        with tempfile.TemporaryDirectory() as tmp:
            t = Path(tmp)
            for d in ("bin", "dev", "proc", "sys", "modules"):
                (t / d).mkdir()
            shutil.copy("/bin/busybox", t / "bin/busybox")
            mods = _module_files(kernel, INITRAMFS_MODULES)
            for m in mods:
                shutil.copy(m, t / "modules" / m.name)
            (t / "modules.order").write_text("\n".join(m.name for m in mods) + "\n")
            (t / "init").write_text(INIT)
            (t / "init").chmod(0o755)
            files = subprocess.run(["find", "."], cwd=t, capture_output=True, text=True,
                                   check=True).stdout
            cpio = subprocess.run(["cpio", "-o", "-H", "newc", "--quiet"], cwd=t, input=files.encode(),
                                  capture_output=True, check=True).stdout
            initramfs.write_bytes(gzip.compress(cpio, 6))
        stamp.write_text(_stamp())
    return Artifacts(kver, kernel.vmlinuz, initramfs, siw, kernel.modules)


#: host folders the guest mounts its own file systems over: a checkout there is hidden
HIDDEN = ("/run", "/proc", "/sys", "/dev")


def unavailable() -> str | None:
    """Why the lab cannot run on this machine, or None."""
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        return "the lab needs an x86_64 Linux host"
    hidden = next((h for h in HIDDEN if ROOT == Path(h) or Path(h) in ROOT.parents), None)
    if hidden:
        return (f"the checkout {ROOT} is under {hidden}, which the guest mounts its own "
                "file system over: clone it elsewhere (/tmp and /var/tmp are fine)")
    if os.geteuid() != 0:
        return "the lab needs root (network namespaces, tap devices)"
    if not os.path.exists("/dev/net/tun"):
        return "no /dev/net/tun: the lab's guest needs a tap device"
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    return None


# -- the guest agent -----------------------------------------------------------------------


class Agent:
    """A client of qemu-ga (QEMU's guest agent) over its virtio-serial socket.

    qemu-ga serves one client at a time; a ``transient`` client connects for each call,
    so that several processes can share a guest that ``tools/rdma_lab.py up`` keeps."""

    def __init__(self, path: Path, timeout: float, transient: bool = False) -> None:
        self.path, self.transient = path, transient
        self._ids = itertools.count(int(time.time() * 1000) % 1000000)
        self.sock: socket.socket | None = None
        if not transient:
            self._connect(timeout)

    def _connect(self, timeout: float) -> None:
        path = self.path
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.sock = socket.socket(socket.AF_UNIX)
                self.sock.connect(str(path))
                break
            except OSError:
                self.sock.close()
                if time.monotonic() > deadline:
                    raise LabError(f"no guest agent socket at {path}") from None
                time.sleep(0.2)
        self._buf = b""
        self._sync(deadline)

    def _sync(self, deadline: float) -> None:
        """guest-sync-delimited until the agent answers (it starts late in the boot)."""
        while True:
            ident = next(self._ids)
            self.sock.sendall(b"\xff" + json.dumps({"execute": "guest-sync-delimited",
                                                    "arguments": {"id": ident}}).encode())
            try:
                reply = self._read(min(2.0, max(0.1, deadline - time.monotonic())), sync=True)
            except TimeoutError:
                reply = None
            if reply is not None and reply.get("return") == ident:
                return
            if time.monotonic() > deadline:
                raise LabError("the guest agent does not answer")

    def _read(self, timeout: float, sync: bool = False) -> dict:
        self.sock.settimeout(timeout)
        while True:
            if sync and b"\xff" in self._buf:
                self._buf = self._buf[self._buf.rindex(b"\xff") + 1:]
                sync = False
            line, nl, rest = self._buf.partition(b"\n")
            if nl and not sync:
                self._buf = rest
                if line.strip():
                    return json.loads(line)
                continue
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                raise TimeoutError("guest agent") from None
            if not chunk:
                raise LabError("the guest agent closed its socket (the guest is gone?)")
            self._buf += chunk

    def call(self, command: str, timeout: float = 30, **arguments) -> object:
        if self.transient:
            self._connect(timeout)
        try:
            self.sock.sendall(json.dumps({"execute": command, "arguments": arguments}).encode())
            reply = self._read(timeout)
        finally:
            if self.transient:
                self.close()
        if "error" in reply:
            raise LabError(f"guest agent {command}: {reply['error'].get('desc', reply['error'])}")
        return reply.get("return")

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


@dataclass
class Process:
    """A command running in the guest, its output in ``log`` (a file of the host's)."""

    lab: Lab
    pid: int
    log: Path
    returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            st = self.lab.agent.call("guest-exec-status", pid=self.pid)
            if st["exited"]:
                self.returncode = st.get("exitcode", -st.get("signal", 0))
        return self.returncode

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait_for(self, text: str, timeout: float) -> str:
        """Wait until ``text`` is in the output; LabError (with the output) if it never is."""
        deadline = time.monotonic() + timeout
        while text not in (out := self.output()):
            if self.poll() is not None or time.monotonic() > deadline:
                raise LabError(f"guest process {self.pid} never printed {text!r} "
                               f"(exit {self.returncode}): {out[-2000:]}")
            time.sleep(0.1)
        return out

    def signal(self, sig: str = "INT") -> None:
        self.lab.run(["kill", f"-{sig}", str(self.pid)], check=False)

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise LabError(f"guest process {self.pid} still running after {timeout} s: "
                               f"{self.output()[-2000:]}")
            time.sleep(0.05)
        return self.returncode

    def stop(self, timeout: float = 20) -> int:
        """SIGINT, then SIGKILL if it does not end."""
        if self.poll() is None:
            self.signal("INT")
            try:
                self.wait(timeout)
            except LabError:
                self.signal("KILL")
                self.wait(10)
        return self.returncode


# -- the lab -------------------------------------------------------------------------------


@dataclass
class Lab:
    """A booted guest: ``with Lab() as lab: lab.run([...])``."""

    memory_mb: int = 2048
    shell: bool = False
    netns: str = field(default_factory=lambda: f"kbtplab{os.getpid() % 100000}")
    boot_seconds: float = 0.0
    attached: bool = False

    def __post_init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kbtp-lab-"))
        self.qemu: subprocess.Popen | None = None
        self.agent: Agent | None = None
        self._count = itertools.count()

    @classmethod
    def running(cls) -> Lab | None:
        """The lab ``tools/rdma_lab.py up`` keeps, if one is up."""
        if not RUNNING.exists():
            return None
        state = json.loads(RUNNING.read_text())
        return cls.attach(Path(state["agent"]), Path(state["dir"]), state["netns"])

    @classmethod
    def attach(cls, agent: Path, directory: Path, netns: str) -> Lab:
        """The lab another process keeps up (``tools/rdma_lab.py up``)."""
        lab = cls.__new__(cls)
        lab.dir, lab.netns, lab.qemu, lab.attached = directory, netns, None, True
        lab._count = itertools.count(int(time.time()))
        lab.agent = Agent(agent, 10, transient=True)
        return lab

    # The guest sees the host's root as its own: absolute paths of the host work there.
    @property
    def guest_dir(self) -> str:
        """The guest's mount point of ``self.dir`` (the same path, read-write)."""
        return str(self.dir)

    def __enter__(self) -> Lab:
        try:
            self.boot()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        """Let other processes (``exec --lab``) use the guest agent meanwhile: qemu-ga serves
        one client at a time, so this process connects only for each call while it lasts."""
        assert self.agent is not None
        held, self.agent = self.agent, Agent(self.agent.path, 10, transient=True)
        held.close()
        try:
            yield
        finally:
            self.agent = Agent(held.path, 30)

    def _ip(self, *args: str) -> None:
        done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
        if done.returncode != 0:
            raise LabError(f"ip {' '.join(args)}: {done.stderr.strip()}")

    def boot(self, timeout: float = 180) -> None:
        why = unavailable()
        if why:
            raise LabError(why)
        art = build()
        start = time.monotonic()
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True)
        self._ip("netns", "add", self.netns)
        self._ip("-n", self.netns, "link", "set", "lo", "up")
        for tap, ips in TAPS:
            self._ip("-n", self.netns, "tuntap", "add", "dev", tap, "mode", "tap")
            for ip in ips:
                self._ip("-n", self.netns, "addr", "add", f"{ip}/24", "dev", tap)
            self._ip("-n", self.netns, "link", "set", tap, "mtu", str(MTU), "up")
        stage2 = (STAGE2.replace("@PATH@", f"{ROOT}/.venv/bin:{GUEST_PATH}").replace("@LAB@", self.guest_dir)
                  .replace("@MODROOT@", str(art.modules))
                  .replace("@ROOT@", str(ROOT)).replace("@MTU@", str(MTU))
                  .replace("@MODULES@", " ".join(GUEST_MODULES)).replace("@SIW@", str(art.siw))
                  .replace("@GUEST_IP@", GUEST_IP).replace("@SIW_GUEST_IP@", SIW_GUEST_IP)
                  .replace("@SIW_INNER_IP@", SIW_INNER_IP).replace("@SIW_PEER_IP@", SIW_PEER_IP))
        initramfs = self._initramfs(art.initramfs, stage2)
        cmdline = f"console=ttyS0 quiet panic=-1 kbtp.shell={int(self.shell)}"
        argv = ["ip", "netns", "exec", self.netns, "qemu-system-x86_64",
                "-accel", "tcg,thread=multi,tb-size=1024", "-cpu", "max", "-smp", "2",
                "-m", str(self.memory_mb), "-nographic", "-no-reboot", "-nodefaults",
                "-kernel", str(art.kernel), "-initrd", str(initramfs), "-append", cmdline,
                "-fsdev", "local,id=hostroot,path=/,readonly=on,security_model=none",
                "-device", "virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot",
                "-fsdev", f"local,id=checkout,path={ROOT},readonly=on,security_model=none",
                "-device", "virtio-9p-pci,fsdev=checkout,mount_tag=checkout",
                "-fsdev", f"local,id=lab,path={self.dir},security_model=none",
                "-device", "virtio-9p-pci,fsdev=lab,mount_tag=lab",
                *(arg for i, (tap, _) in enumerate(TAPS) for arg in (
                    "-netdev", f"tap,id=n{i},ifname={tap},script=no,downscript=no",
                    "-device", f"virtio-net-pci,netdev=n{i},mac=52:54:00:99:0{i}:01")),
                "-chardev", f"socket,id=qga,path={self.dir}/qga.sock,server=on,wait=off",
                "-device", "virtio-serial-pci",
                "-device", "virtserialport,chardev=qga,name=org.qemu.guest_agent.0"]
        if self.shell:
            argv += ["-serial", "mon:stdio"]
            self.qemu = subprocess.Popen(argv)
            return
        argv += ["-serial", f"file:{self.dir}/console.log"]
        self.qemu = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=open(self.dir / "qemu.log", "wb"))
        deadline = time.monotonic() + timeout
        console = self.dir / "console.log"
        while "lab: ready" not in (text := console.read_text(errors="replace") if console.exists() else ""):
            if self.qemu.poll() is not None or time.monotonic() > deadline:
                qemu = (self.dir / "qemu.log").read_text(errors="replace")
                raise LabError(f"the guest did not come up within {timeout:.0f} s "
                               f"(QEMU {self.qemu.poll()}): {qemu[-500:]} {text[-1500:]}")
            time.sleep(0.2)
        problems = [line for line in text.splitlines() if line.startswith("lab: ") and "ready" not in line]
        if problems:
            raise LabError(f"the guest came up with errors: {'; '.join(problems)}")
        self.agent = Agent(self.dir / "qga.sock", max(10, deadline - time.monotonic()))
        self.boot_seconds = time.monotonic() - start

    def _initramfs(self, base: Path, stage2: str) -> Path:
        """The built initramfs with this boot's stage 2 appended (cpio archives concatenate)."""
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "stage2.sh").write_text(stage2)
            cpio = subprocess.run(["cpio", "-o", "-H", "newc", "--quiet"], cwd=tmp,
                                  input=b"stage2.sh\n", capture_output=True, check=True).stdout
        out = self.dir / "initramfs.gz"
        out.write_bytes(base.read_bytes() + gzip.compress(cpio))
        return out

    # -- running things in the guest ----------------------------------------------------

    def env(self, extra: dict[str, str] | None = None) -> list[str]:
        env = {"PATH": f"{ROOT}/.venv/bin:{GUEST_PATH}", "HOME": "/tmp/home", "PYTHONDONTWRITEBYTECODE": "1",
               "LANG": "C.UTF-8", **(extra or {})}
        return [f"{k}={v}" for k, v in env.items()]

    def run(self, argv: list[str], *, timeout: float = 120, check: bool = True,
            env: dict[str, str] | None = None, input: bytes | None = None) -> Result:
        """Run ``argv`` in the guest to completion; LabError if it fails and ``check``."""
        args = {"path": argv[0], "arg": argv[1:], "env": self.env(env), "capture-output": True}
        if input is not None:
            args["input-data"] = base64.b64encode(input).decode()
        pid = self.agent.call("guest-exec", **args)["pid"]
        deadline = time.monotonic() + timeout
        delay = 0.02
        while True:
            st = self.agent.call("guest-exec-status", pid=pid)
            if st["exited"]:
                break
            if time.monotonic() > deadline:
                self.agent.call("guest-exec", path="kill", arg=["-KILL", str(pid)], env=self.env())
                raise LabError(f"guest command timed out after {timeout} s: {shlex.join(argv)}")
            time.sleep(delay)
            delay = min(0.2, delay * 1.5)
        res = Result(st.get("exitcode", -st.get("signal", 0)),
                     base64.b64decode(st.get("out-data", "")).decode(errors="replace"),
                     base64.b64decode(st.get("err-data", "")).decode(errors="replace"))
        if check and res.returncode != 0:
            raise LabError(f"guest command failed ({res.returncode}): {shlex.join(argv)}: "
                           f"{(res.stderr or res.stdout).strip()[-2000:]}")
        return res

    def spawn(self, argv: list[str], *, env: dict[str, str] | None = None,
              name: str | None = None) -> Process:
        """Start ``argv`` in the guest in the background, stdout and stderr to a log."""
        log_path = self.dir / f"{name or 'proc'}-{next(self._count)}.log"
        script = 'exec "$@" >"$LOG" 2>&1 </dev/null'
        pid = self.agent.call("guest-exec", path="/bin/sh",
                              arg=["-c", script, "sh", *argv],
                              env=self.env({**(env or {}), "LOG": str(log_path)}))["pid"]
        return Process(self, pid, log_path)

    def stream(self, argv: list[str], timeout: float, env: dict[str, str] | None = None) -> int:
        """Run ``argv`` in the guest from the checkout (``kbtp`` on its PATH), its output
        (stdout and stderr, as one) shown here as it comes; Ctrl-C stops it. The guest kills
        it after ``timeout`` by itself too, for a caller that is killed outright."""
        proc = self.spawn(["/bin/sh", "-c", 'cd "$0" && t=$1 && shift && exec timeout -s KILL "$t" "$@"', str(ROOT),
                           f"{timeout:g}", *argv], name="exec", env=env)
        shown = 0
        deadline = time.monotonic() + timeout
        try:
            while True:
                done = proc.poll() is not None
                if proc.log.exists():
                    with proc.log.open("rb") as f:
                        f.seek(shown)
                        chunk = f.read()
                    shown += len(chunk)
                    sys.stdout.buffer.write(chunk)
                    sys.stdout.flush()
                if done:
                    return proc.returncode
                if time.monotonic() > deadline:
                    proc.stop()
                    raise LabError(f"guest command still running after {timeout:g} s: {shlex.join(argv)}")
                time.sleep(0.2)
        except KeyboardInterrupt:
            proc.stop()
            raise

    def python(self, *args: str) -> list[str]:
        """argv for this checkout's Python in the guest."""
        return [str(ROOT / ".venv/bin/python"), *args]

    def kbtp(self, *args: str) -> list[str]:
        """argv for this checkout's ``kbtp`` command in the guest."""
        return [str(ROOT / ".venv/bin/kbtp"), *args]

    def close(self) -> None:
        """Power the guest off (QEMU is killed if it does not go), remove the namespace;
        a lab ``attach`` found is left running for its owner."""
        if self.attached:
            self.agent.close()
            return
        try:
            if self.agent is not None:
                with contextlib.suppress(Exception):
                    self.agent.call("guest-exec", timeout=5, path="busybox", arg=["poweroff", "-f"],
                                    env=self.env())
                self.agent.close()
                self.agent = None
        finally:
            if self.qemu is not None:
                try:
                    self.qemu.wait(10)
                except subprocess.TimeoutExpired:
                    self.qemu.kill()
                    self.qemu.wait(10)
                self.qemu = None
            subprocess.run(["ip", "netns", "del", self.netns], capture_output=True)
            shutil.rmtree(self.dir, ignore_errors=True)


# -- command line --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tools/rdma_lab.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="A QEMU guest with the kernel's rxe and siw, for testing against real "
                    "RDMA stacks.",
        epilog="examples:\n"
               "  tools/rdma_lab.py build\n"
               "  tools/rdma_lab.py run -- rdma link show\n"
               "  tools/rdma_lab.py run -- ibv_devinfo -d rxe0\n"
               "  tools/rdma_lab.py shell\n")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="install the Debian packages, build siw.ko and the initramfs")
    sub.add_parser("shell", help="boot and get an interactive shell in the guest (exit with Ctrl-D)")
    run = sub.add_parser("run", help="boot, run one command in the guest, print its output")
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="the command (after --)")
    sub.add_parser("up", help="boot and keep the guest up until Ctrl-C (for 'exec')")
    ex = sub.add_parser("exec", help="run one command in the guest that 'up' keeps running, "
                                     "the caller's KBTP_* variables passed on")
    ex.add_argument("--lab", type=Path, metavar="DIR",
                    help="the directory of a lab another process booted (Lab.dir) instead of 'up's")
    ex.add_argument("--timeout", type=float, default=3600, metavar="SECONDS",
                    help="kill the command after this long, in the guest too [3600]")
    ex.add_argument("cmd", nargs=argparse.REMAINDER, help="the command (after --)")
    args = parser.parse_args(argv)
    # Ctrl-C and SIGTERM both end the lab cleanly (a background job starts with SIGINT ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        if args.command == "build":
            art = build()
            log(f"ready: kernel {art.kver}, {art.siw}, {art.initramfs}")
            return 0
        if args.command == "shell":
            lab = Lab(shell=True)
            try:
                lab.boot()
                log(f"guest {GUEST_IP} (rxe0), {SIW_GUEST_IP} (siw0); host side {HOST_IP}, "
                    f"{SIW_HOST_IP} in netns {lab.netns}; Ctrl-A x stops QEMU")
                return lab.qemu.wait()
            finally:
                lab.qemu = None
                lab.close()
        if args.command == "up":
            with Lab() as lab:
                RUNNING.write_text(json.dumps({"agent": str(lab.dir / "qga.sock"),
                                               "dir": str(lab.dir), "netns": lab.netns}))
                log(f"guest up in {lab.boot_seconds:.1f} s: {GUEST_IP} (rxe0), "
                    f"{SIW_GUEST_IP} (siw0); host side {HOST_IP}, {SIW_HOST_IP} in netns "
                    f"{lab.netns} (ip netns exec {lab.netns} ...); /lab is {lab.dir}; Ctrl-C stops it")
                lab.agent.close()      # the agent takes one client at a time: 'exec'
                lab.agent = Agent(lab.dir / "qga.sock", 5, transient=True)
                try:
                    lab.qemu.wait()
                except KeyboardInterrupt:
                    pass
                finally:
                    RUNNING.unlink(missing_ok=True)
            return 0
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        if not cmd:
            parser.error(f"{args.command}: give the command after --")
        if args.command == "exec":
            lab = Lab.attach(args.lab / "qga.sock", args.lab, "") if args.lab else Lab.running()
            if lab is None:
                raise LabError("no lab is up: start 'tools/rdma_lab.py up' first")
            passed = {k: v for k, v in os.environ.items() if k.startswith("KBTP_")}
            try:
                return lab.stream(cmd, timeout=args.timeout, env=passed)
            finally:
                lab.agent.close()
        with Lab() as lab:
            log(f"guest up in {lab.boot_seconds:.1f} s")
            return lab.stream(cmd, timeout=3600)
    except LabError as exc:
        log(str(exc))
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
