#!/usr/bin/env bash
# Install everything the project needs on Debian 12 (as root) into ./.venv, idempotently:
# tshark, python3-venv, the C dissector's build tools (gcc, pkg-config, Wireshark's and
# GLib's headers), headless Chromium and the Wireshark GUI under Xvfb from Debian's packages, the package and its test and plot extras from PyPI.
# Fast when everything is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v tshark >/dev/null 2>&1 || missing+=(tshark)
python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || missing+=(python3-venv)
command -v gcc >/dev/null 2>&1 || missing+=(gcc libc6-dev)
command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
[ -f /usr/include/wireshark/epan/packet.h ] || missing+=(libwireshark-dev)
[ -f /usr/include/glib-2.0/glib.h ] || missing+=(libglib2.0-dev)
# headless Chromium, which renders kbtp conform --html in the suite (tests/test_conform_browser.py)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
# the Wireshark GUI under a virtual display, for the screenshot test (tests/test_dissector_gui.py)
for tool in wireshark:wireshark-qt Xvfb:xvfb xdotool:xdotool xclip:xclip xwd:x11-apps xwdtopnm:netpbm; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || missing+=("${tool#*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "install.sh: installing ${missing[*]} from Debian's packages" >&2
  export DEBIAN_FRONTEND=noninteractive
  echo "wireshark-common wireshark-common/install-setuid boolean false" | debconf-set-selections
  # wait (up to 10 min) for another apt, such as unattended upgrades on a fresh VM, to let go
  lock=(-o DPkg::Lock::Timeout=600)
  apt-get "${lock[@]}" update -qq
  apt-get "${lock[@]}" install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
stamp=.venv/.kbtp-installed
# the compiled decoder core's sources too: pip install rebuilds it when they change
want=$(cat pyproject.toml kbtp_scapy/decode/_core*.[ch] | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "install.sh: installing kbtp_scapy and its test extras into .venv" >&2
  .venv/bin/python -m pip install -q -e '.[test,plot]' 2>&1 | grep -v -e '^WARNING: Location' -e 'BuildBackendWarning' >&2 || true
  .venv/bin/python -c 'import kbtp_scapy.cli, pytest, hypothesis, pyshark'
  echo "$want" > "$stamp"
fi
