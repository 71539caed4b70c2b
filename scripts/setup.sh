#!/usr/bin/env bash
# Set-up on a Debian machine that touches nothing it need not.
#
#   bash scripts/setup.sh --for demo     the main job: a virtualenv in .venv with PyTorch (CPU build, installed
#                                        first so that nothing resolves a multi-GB CUDA build) and this project
#                                        with its `report` extra. System-wide: only python3-venv, if Python
#                                        lacks it.
#   bash scripts/setup.sh --for tests    the same with the `dev` extras, plus the servers the tests start:
#                                        etcd and Prometheus (with promtool) unpacked from Debian's packages
#                                        into .servers/ in this checkout, nothing installed system-wide; and
#                                        Debian's prometheus-alertmanager (with amtool), installed system-wide
#                                        because its build reads its templates from /usr/share, with its
#                                        service neither started nor enabled.
#                                        And a second virtualenv, .venv-torch-next, with the next torch
#                                        release (NEXT_TORCH_SPEC, torch==2.14.1; its wheel is a CUDA build, about
#                                        5 GB installed) and every other package taken from .venv: the tests run
#                                        the in-process, sharded and checkpoint tests under it too.
#   --dry-run                            print the plan and change nothing.
#
# System packages (python3-venv; openssl and mount for the tests, when missing) are installed with apt-get as
# root, or through sudo otherwise; without either it stops and says what to install. Safe to run again: what
# is already there is kept.
set -euo pipefail
cd "$(dirname "$0")/.."

target=""
dry_run=0
while (($#)); do
    case "$1" in
        --for) target=${2:-}; shift 2 ;;
        --for=*) target=${1#--for=}; shift ;;
        --dry-run) dry_run=1; shift ;;
        -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
        *) echo "setup.sh: unknown argument '$1'; use --for demo|tests [--dry-run]" >&2; exit 2 ;;
    esac
done
case "$target" in
    demo) extras="report" ;;
    tests) extras="dev" ;;
    *) echo "setup.sh: say what to set up: --for demo (the main job) or --for tests (the test suite)" >&2; exit 2 ;;
esac

PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
NEXT_TORCH_SPEC=${NEXT_TORCH_SPEC:-torch==2.14.1}
NEXT_VENV=.venv-torch-next
SERVERS_DIR=.servers
# Debian package -> the binaries the tests run from it.
declare -A SERVER_BINARIES=(
    [etcd-server]="etcd"
    [prometheus]="prometheus promtool"
)
SYSTEM_SERVER=prometheus-alertmanager  # reads /usr/share/prometheus/alertmanager/*.tmpl: cannot run unpacked
SLURM_PACKAGES=(slurmctld slurmd slurm-client munge)  # a single-node Slurm the deployment tests start and stop

plan() { echo "setup ($target): $*"; }

apt_packages=()
"$PY" -c "import venv, ensurepip" 2>/dev/null || apt_packages+=(python3-venv python3-pip)
servers=()
if [ "$target" = tests ]; then
    command -v openssl >/dev/null || apt_packages+=(openssl)  # certificates for the etcd TLS test
    command -v mount >/dev/null || apt_packages+=(mount)      # a tiny tmpfs for the full-disk test
    command -v ip >/dev/null || apt_packages+=(iproute2)      # network namespaces for the network drills
    command -v iptables >/dev/null || apt_packages+=(iptables) # their packet loss (a command, no service)
    command -v shellcheck >/dev/null || apt_packages+=(shellcheck)          # the rendered Slurm scripts
    command -v docker-compose >/dev/null || apt_packages+=(docker-compose)  # `config -q` of the compose file
    command -v debootstrap >/dev/null || apt_packages+=(debootstrap)  # the compose test's base image, built here
    system_servers=()
    command -v prometheus-alertmanager >/dev/null && command -v amtool >/dev/null || system_servers+=("$SYSTEM_SERVER")
    # a container engine the compose test starts by hand on a socket of its own (docker.io: dockerd, containerd)
    command -v dockerd >/dev/null || [ -x /usr/sbin/dockerd ] || system_servers+=(docker.io)
    for bin in slurmctld slurmd sbatch munged; do
        if ! command -v "$bin" >/dev/null && [ ! -x "/usr/sbin/$bin" ]; then
            system_servers+=("${SLURM_PACKAGES[@]}")
            break
        fi
    done
    for package in "${!SERVER_BINARIES[@]}"; do
        for bin in ${SERVER_BINARIES[$package]}; do
            if [ ! -x "$SERVERS_DIR/usr/bin/$bin" ]; then
                servers+=("$package")
                break
            fi
        done
    done
fi

as_root=()
system_servers=("${system_servers[@]}")
system_server="${system_servers[*]}"
if ((${#apt_packages[@]} || ${#servers[@]})) || [ -n "$system_server" ]; then
    if [ "$(id -u)" != 0 ]; then
        if command -v sudo >/dev/null; then
            as_root=(sudo)
        elif ((${#apt_packages[@]})) || [ -n "$system_server" ]; then
            echo "setup.sh: need root or sudo to install Debian packages: ${apt_packages[*]} $system_server." >&2
            echo "  Ask an administrator to run: apt-get install --no-install-recommends" \
                 "${apt_packages[*]} $system_server; then run this again." >&2
            exit 1
        fi
    fi
fi

if ((${#apt_packages[@]})); then
    plan "install Debian packages system-wide: ${apt_packages[*]}"
else
    plan "no Debian package to install system-wide"
fi
if ((${#servers[@]})); then
    plan "unpack ${servers[*]} into $SERVERS_DIR/ (apt-get download + dpkg-deb -x): nothing installed" \
         "system-wide, no service enabled or started; the tests start them on loopback ports"
elif [ "$target" = tests ]; then
    plan "servers for the tests already in $SERVERS_DIR/"
fi
if [ -n "$system_server" ]; then
    plan "install Debian $system_server system-wide without recommends; their services are neither started" \
         "(policy-rc.d) nor enabled (deb-systemd-helper disable, update-rc.d disable)"
fi
[ -x .venv/bin/python ] || plan "create the virtualenv .venv (with --system-site-packages, reusing a torch you have)"
plan "pip install into .venv: $TORCH_SPEC, then this project with extras [$extras]"
[ "$target" = tests ] && plan "pip install into $NEXT_VENV: $NEXT_TORCH_SPEC (the rest from .venv)"
if ((dry_run)); then
    plan "dry run: nothing changed"
    exit 0
fi

if ((${#apt_packages[@]})); then
    "${as_root[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -qq --no-install-recommends "${apt_packages[@]}"
fi

if [ -n "$system_server" ]; then
    policy_made=0
    if [ ! -e /usr/sbin/policy-rc.d ]; then  # Debian's switch that keeps package scripts from starting services
        printf '#!/bin/sh\nexit 101\n' | "${as_root[@]}" tee /usr/sbin/policy-rc.d >/dev/null
        "${as_root[@]}" chmod 0755 /usr/sbin/policy-rc.d
        policy_made=1
    fi
    ((${#apt_packages[@]})) || "${as_root[@]}" apt-get update -qq
    installed=0
    DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -qq --no-install-recommends "${system_servers[@]}" \
        && installed=1
    ((policy_made)) && "${as_root[@]}" rm -f /usr/sbin/policy-rc.d
    ((installed)) || { echo "setup.sh: could not install $system_server (see above)" >&2; exit 1; }
    for package in "${system_servers[@]}"; do
        [ "$package" = slurm-client ] && continue  # commands only
        services=("$package")
        [ "$package" = docker.io ] && services=(docker containerd)
        for service in "${services[@]}"; do
            "${as_root[@]}" deb-systemd-helper disable "$service.service" >/dev/null 2>&1 || true
            "${as_root[@]}" update-rc.d "$service" disable >/dev/null 2>&1 || true
        done
        [ "$package" = docker.io ] && { "${as_root[@]}" deb-systemd-helper disable docker.socket >/dev/null 2>&1 || true; }
    done
    echo "setup ($target): installed $system_server; their services are not enabled and were not started"
fi

if ((${#servers[@]})); then
    # apt-get download needs package lists; refresh them only when apt knows none of the packages.
    if ! apt-cache show "${servers[@]}" >/dev/null 2>&1; then
        if [ "$(id -u)" != 0 ] && ((${#as_root[@]} == 0)); then
            echo "setup.sh: apt knows no ${servers[*]} and refreshing its lists needs root or sudo." >&2
            echo "  Ask an administrator to run: apt-get update; then run this again." >&2
            exit 1
        fi
        "${as_root[@]}" apt-get update -qq
    fi
    debs=$(mktemp -d)
    trap 'rm -rf "$debs"' EXIT
    chmod 0777 "$debs"  # apt downloads as its own unprivileged user where it can
    if ! (cd "$debs" && apt-get download -qq "${servers[@]}") >"$debs/download.log" 2>&1; then
        cat "$debs/download.log" >&2
        echo "setup.sh: could not download ${servers[*]} from Debian's archive (see above)" >&2
        exit 1
    fi
    mkdir -p "$SERVERS_DIR"
    for deb in "$debs"/*.deb; do
        dpkg-deb -x "$deb" "$SERVERS_DIR"
        echo "setup ($target): unpacked $(dpkg-deb -f "$deb" Package) $(dpkg-deb -f "$deb" Version) into $SERVERS_DIR/"
    done
    for package in "${servers[@]}"; do
        for bin in ${SERVER_BINARIES[$package]}; do
            [ -x "$SERVERS_DIR/usr/bin/$bin" ] || { echo "setup.sh: $package did not provide usr/bin/$bin" >&2; exit 1; }
        done
    done
fi

# --system-site-packages reuses a torch that the machine already has.
[ -x .venv/bin/python ] || "$PY" -m venv --system-site-packages .venv
.venv/bin/python -m pip install -q --disable-pip-version-check "$TORCH_SPEC"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[$extras]"

if [ "$target" = tests ]; then
    # The same tests under the next torch release: its own torch, every other package (and this project) from
    # .venv, whose site directory a .pth adds after this one's, so that torch is found here first.
    [ -x "$NEXT_VENV/bin/python" ] || "$PY" -m venv --system-site-packages "$NEXT_VENV"
    "$NEXT_VENV/bin/python" -m pip install -q --disable-pip-version-check "$NEXT_TORCH_SPEC"
    main_site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    next_site=$("$NEXT_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "import site; site.addsitedir('$main_site')" > "$next_site/zz-resilient-main-venv.pth"
fi
