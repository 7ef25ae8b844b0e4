#!/usr/bin/env bash
# Installs a working CRIU 4.x for cuinterpose on Debian and Ubuntu. Idempotent; see docs/criu.md.
# The one installer: `cuinterpose-agent install-criu` (from the wheel) and scripts/install-criu.sh
# (`make criu`, from a checkout) both run this file, with CUINTERPOSE_CRIU_CACHE set.
#
# 1. If the system `criu` is 4.x or later and passes `criu check`, use it and stop.
# 2. If $CUINTERPOSE_CRIU_CACHE/bin/criu already reports 4.x and passes `criu check`, stop.
# 3. Otherwise fetch CRIU 4.x and its runtime libraries (libc6 included) from the next release
#    of this machine's distribution (Debian: trixie; Ubuntu: resolute, 26.04 LTS, universe)
#    with `apt-get download`, using a private apt state directory built from this machine's
#    own sources with only the suite changed, unpack them with `dpkg -x` into
#    $CUINTERPOSE_CRIU_CACHE/root, and write the wrapper $CUINTERPOSE_CRIU_CACHE/bin/criu that
#    runs the real binary through that folder's own ld.so with --library-path.
#    Nothing is installed into the system; the system's apt configuration is not changed.
#    The downloaded .debs stay in the apt state directory (checked against the signed index by
#    SHA-256 and reused by the next install).
#
# For a machine without network (scripts/gpu-check.sh carries CRIU to the GPU machine):
#   --pack FILE          tar+gzip the installed root (after 3 here) into FILE
#   --from-archive FILE  unpack FILE into the cache and write the wrapper there
#
# Environment:
#   CUINTERPOSE_CRIU_CACHE   install folder (required; the callers above set it)
#   CUINTERPOSE_CRIU_APT     private apt state and downloaded .debs (default: <cache>/apt)
#   CRIU_SUITE               suite to fetch from (default: trixie on Debian, resolute on Ubuntu)
#   CRIU_FORCE_CACHE=1       install the cached copy even when the system criu works
#   CRIU_OS_RELEASE          the os-release file read for the distribution (default /etc/os-release)
# Exit status: 0 when a working CRIU is available, 1 otherwise (with the reason on stderr).
set -euo pipefail

CACHE=${CUINTERPOSE_CRIU_CACHE:?set CUINTERPOSE_CRIU_CACHE to the install folder (cuinterpose-agent install-criu and scripts/install-criu.sh do)}
WRAPPER=$CACHE/bin/criu
MIN_MAJOR=4
OS_RELEASE=${CRIU_OS_RELEASE:-/etc/os-release}
say() { echo "install-criu: $*" >&2; }
indent() { sed 's/^/    /'; }   # stdin to stdout, every line indented by four spaces
die() { say "error: $*"; exit 1; }

# CRIU must never run with an inherited preload or library path.
unset LD_PRELOAD LD_LIBRARY_PATH LD_AUDIT CRIU_CONFIG_FILE

# criu_major ARGV... -> prints the major version, fails if `criu --version` does not run.
criu_major() {
  local out
  out=$("$@" --version 2>&1) || return 1
  [[ $out =~ Version:\ *([0-9]+)\. ]] || return 1
  echo "${BASH_REMATCH[1]}"
}

# criu_check ARGV... -> 0 when `criu check` says "Looks good"; the output is kept in CHECK_OUT.
CHECK_OUT=
criu_check() {
  CHECK_OUT=$("$@" check --no-default-config 2>&1) && grep -q "Looks good" <<<"$CHECK_OUT"
}

# MANUAL: what to do where this installer cannot (another distribution, an old keyring, ...).
MANUAL="install CRIU >= $MIN_MAJOR.0 yourself (your distribution's criu package where it is 4.x, \
else built from CRIU's source release), then put it on PATH or set CUINTERPOSE_CRIU=/path/to/criu"

# The distribution, from os-release: DISTRO (debian | ubuntu), CODENAME (this release's suite)
# and SUITE (where CRIU 4.x comes from: $CRIU_SUITE, else trixie or resolute). Ubuntu's
# derivatives (ID_LIKE=ubuntu) name their base release in UBUNTU_CODENAME.
distro() {
  local id like
  [ -r "$OS_RELEASE" ] || die "cannot read $OS_RELEASE to tell the distribution; $MANUAL"
  # shellcheck source=/dev/null  # the machine's os-release, read at run time
  id=$(. "$OS_RELEASE" && echo "${ID:-}")
  # shellcheck source=/dev/null
  like=$(. "$OS_RELEASE" && echo " ${ID_LIKE:-} ")
  if [ "$id" = ubuntu ] || [[ $like == *" ubuntu "* ]]; then
    DISTRO=ubuntu
    # shellcheck source=/dev/null
    CODENAME=$(. "$OS_RELEASE" && echo "${UBUNTU_CODENAME:-${VERSION_CODENAME:-}}")
    SUITE=${CRIU_SUITE:-resolute}
  elif [ "$id" = debian ] || [[ $like == *" debian "* ]]; then
    DISTRO=debian
    # shellcheck source=/dev/null
    CODENAME=$(. "$OS_RELEASE" && echo "${VERSION_CODENAME:-}")
    SUITE=${CRIU_SUITE:-trixie}
  else
    die "this installer knows Debian and Ubuntu, not '$id' ($OS_RELEASE); $MANUAL"
  fi
  [ -n "$CODENAME" ] || die "$OS_RELEASE has no VERSION_CODENAME; $MANUAL"
}

# Build the temporary sources from the machine's own archive entries (deb822 *.sources and
# one-line sources.list / *.list), changing only the suite: <codename>[-x] -> <suite>[-x].
# Every other field/option (URIs, components, Signed-By, Check-Valid-Until, ...) is kept; on
# Ubuntu, where criu is in universe, universe is added to the components when missing.
# Kept entries: deb (not deb-src), enabled, a <codename>* suite, and the distribution's own
# archive (Signed-By naming a debian-archive / ubuntu-archive keyring, or no Signed-By and a
# .../debian, .../debian-security, .../ubuntu or .../ubuntu-ports URI); third-party
# repositories are dropped.
# CRIU_APT_SOURCES=<file.sources> replaces all of this with a file of your own.
# CRIU_APT_ETC (default /etc/apt) is where the machine's sources are read from.
write_sources() {  # OUT_SOURCES OUT_LIST
  : > "$2"
  if [ -n "${CRIU_APT_SOURCES:-}" ]; then
    cp -- "$CRIU_APT_SOURCES" "$1"
    return
  fi
  python3 - "$DISTRO" "$CODENAME" "$SUITE" "$1" "$2" "${CRIU_APT_ETC:-/etc/apt}" <<'PY' || die "cannot derive $SUITE sources"
import glob, re, sys
distro, codename, suite, out822, out_list, etc = sys.argv[1:]
ARCHIVE_URI = {"debian": r"/debian(-security)?/?$", "ubuntu": r"/ubuntu(-ports)?/?$"}[distro]

def map_suite(s):
    if s == codename or s.startswith(codename + "-"):
        return suite + s[len(codename):]
    return None

def is_archive(uris, signed_by):
    if signed_by:
        return f"{distro}-archive" in signed_by
    return any(re.search(ARCHIVE_URI, u) for u in uris.split())

def components(c):  # criu is in Ubuntu's universe
    return c if distro != "ubuntu" or "universe" in c.split() else f"{c} universe"

stanzas = []
for path in sorted(glob.glob(f"{etc}/sources.list.d/*.sources")):
    for block in re.split(r"\n[ \t]*\n", open(path).read()):
        fields = []                              # [key, value-with-continuations]
        for line in block.splitlines():
            if line.startswith("#"):
                continue
            if line[:1] in (" ", "\t") and fields:
                fields[-1][1] += "\n" + line
            elif ":" in line:
                k, _, v = line.partition(":")
                fields.append([k.strip(), v.strip()])
        get = {k.lower(): v for k, v in fields}
        if not fields or get.get("enabled", "yes").strip().lower() == "no":
            continue
        if "deb" not in get.get("types", "").split():
            continue
        suites = [m for m in map(map_suite, get.get("suites", "").split()) if m]
        if not suites or not is_archive(get.get("uris", ""), get.get("signed-by", "")):
            continue
        for f in fields:
            if f[0].lower() == "types":
                f[1] = "deb"
            elif f[0].lower() == "suites":
                f[1] = " ".join(suites)
            elif f[0].lower() == "components":
                f[1] = components(f[1])
        stanzas.append("".join(f"{k}: {v}\n" for k, v in fields))

one_line = []
for path in [f"{etc}/sources.list"] + sorted(glob.glob(f"{etc}/sources.list.d/*.list")):
    try:
        text = open(path).read()
    except FileNotFoundError:
        continue
    for line in text.splitlines():
        m = re.match(r"\s*deb\s+(\[[^\]]*\]\s+)?(\S+)\s+(\S+)(\s+.*)?$", line.split("#", 1)[0])
        if not m:
            continue
        opts, uri, s = m.group(1) or "", m.group(2), map_suite(m.group(3))
        sb = re.search(r"signed-by=(\S+?)\]?(\s|$)", opts)
        if s and is_archive(uri, sb.group(1) if sb else ""):
            one_line.append(f"deb {opts}{uri} {s} {components(m.group(4) or '').strip()}\n")

if not stanzas and not one_line:
    sys.exit(f"no {distro.capitalize()} archive '{codename}' entries in {etc}/sources.list(.d)"
             f" to derive {suite} from; set CRIU_APT_SOURCES")
open(out822, "w").write("\n".join(stanzas))
open(out_list, "w").write("".join(one_line))
PY
}

# finish_install WHAT: $STAGE/root holds an unpacked CRIU and its libraries; write the
# wrapper, swap the install into $CACHE, and check it. WHAT names it in the wrapper.
finish_install() {
  local what=$1 LIB=$STAGE/root/usr/lib/$TRIPLET ldsos LDSO major
  shopt -s nullglob
  ldsos=("$LIB"/ld-linux*.so.*)
  [ ${#ldsos[@]} -gt 0 ] || die "no ld.so in the unpacked libc6 ($LIB)"
  LDSO=${ldsos[0]##*/}
  [ -x "$STAGE/root/usr/sbin/criu" ] || die "criu binary missing from the unpacked package"
  # Plugin directory passed with --libdir by agent/criu.py: empty on purpose (no plugins).
  mkdir -p "$STAGE/plugins"
  [ -f "$STAGE/PACKAGES" ] || die "no PACKAGES list beside the unpacked root"

  mkdir -p "$STAGE/bin"
  cat > "$STAGE/bin/criu" <<EOF
#!/bin/sh
# Generated by cuinterpose's criu_install.sh: runs $what through the
# ld.so and libraries unpacked in $CACHE/root, never the system's libc.
# The caller's preload, library path and CRIU config file are dropped (this shell was already
# loaded with them; CRIU is not), and the locale is C (no system locale data needed).
# Nothing else runs here: no helper processes, only exec.
unset LD_PRELOAD LD_LIBRARY_PATH LD_AUDIT CRIU_CONFIG_FILE
LC_ALL=C; export LC_ALL
exec "$CACHE/root/usr/lib/$TRIPLET/$LDSO" --inhibit-cache \\
  --library-path "$CACHE/root/usr/lib/$TRIPLET" --argv0 criu "$CACHE/root/usr/sbin/criu" "\$@"
EOF
  chmod 0755 "$STAGE/bin/criu"

  # Swap the new install in (PACKAGES lists the .debs it was unpacked from). The wrapper holds
  # absolute paths: if the repo moves, step 2 sees it broken and this reinstalls.
  rm -rf "${CACHE:?}/root" "${CACHE:?}/bin" "${CACHE:?}/plugins"
  mv "$STAGE/root" "$CACHE/root"
  mv "$STAGE/plugins" "$CACHE/plugins"
  mv "$STAGE/PACKAGES" "$CACHE/PACKAGES"
  mv "$STAGE/bin" "$CACHE/bin"

  major=$(criu_major "$WRAPPER") || die "$WRAPPER --version does not run: $("$WRAPPER" --version 2>&1 | tail -3)"
  [ "$major" -ge "$MIN_MAJOR" ] || die "$WRAPPER is version $major, need >= $MIN_MAJOR"
  if ! criu_check "$WRAPPER"; then
    say "installed $WRAPPER ($("$WRAPPER" --version | head -1)) but 'criu check' fails:"
    indent <<<"$CHECK_OUT" >&2
    exit 1
  fi
  say "installed $WRAPPER: $("$WRAPPER" --version | head -1); criu check: $(tail -1 <<<"$CHECK_OUT")"
}

if [ "${1:-}" = --print-sources ]; then      # debugging aid: show the derived sources, exit
  distro
  tmp=$(mktemp -d); write_sources "$tmp/s.sources" "$tmp/s.list"
  cat "$tmp/s.sources"; echo "# one-line:"; cat "$tmp/s.list"; rm -rf "$tmp"; exit 0
fi

# --- archive modes: carry this cache's CRIU to a machine without network ----------------
if [ "${1:-}" = --pack ]; then
  [ -n "${2:-}" ] || die "--pack needs a FILE"
  # Only that the binary runs: `criu check` tests this kernel, not the one it is carried to.
  { [ -x "$WRAPPER" ] && major=$(criu_major "$WRAPPER") && [ "$major" -ge "$MIN_MAJOR" ]; } \
    || die "no CRIU >= $MIN_MAJOR at $WRAPPER to pack: run scripts/install-criu.sh (make criu) first"
  tar -C "$CACHE" -czf "$2" root PACKAGES || die "cannot write $2"
  say "packed $CACHE/root into $2 ($(du -h "$2" | cut -f1))"
  exit 0
fi
if [ "${1:-}" = --from-archive ]; then
  [ -f "${2:-}" ] || die "--from-archive needs an existing FILE (given: '${2:-}')"
  case $(uname -m) in
    x86_64) TRIPLET=x86_64-linux-gnu ;;
    aarch64) TRIPLET=aarch64-linux-gnu ;;
    *) die "unsupported machine $(uname -m)" ;;
  esac
  mkdir -p "$CACHE"
  STAGE=$CACHE/.stage.$$
  trap 'rm -rf "$STAGE"' EXIT
  mkdir -p "$STAGE"
  tar -C "$STAGE" -xzf "$2" || die "cannot unpack $2"
  finish_install "the CRIU of $(grep -m1 '^criu_' "$STAGE/PACKAGES" || echo "$2"), unpacked from $2,"
  exit 0
fi

# --- 1. system criu ----------------------------------------------------------------------
if [ "${CRIU_FORCE_CACHE:-0}" != 1 ] && command -v criu >/dev/null 2>&1; then
  if ! major=$(criu_major criu); then
    say "system criu ($(command -v criu)) does not report its version (kept as is, not used)"
  elif [ "$major" -lt "$MIN_MAJOR" ]; then
    say "system criu is $(criu --version 2>&1 | head -1), need >= $MIN_MAJOR (kept as is, not used)"
  elif criu_check criu; then
    say "system criu works ($(command -v criu), $(criu --version 2>&1 | head -1)); nothing to install"
    exit 0
  else
    say "system criu fails 'criu check' (kept as is, not used):"
    indent <<<"$CHECK_OUT" | tail -5 >&2
  fi
fi

# --- 2. already installed ----------------------------------------------------------------
cached_works() {
  [ -x "$WRAPPER" ] && major=$(criu_major "$WRAPPER") && [ "$major" -ge "$MIN_MAJOR" ] \
    && criu_check "$WRAPPER"
}
if cached_works; then
  say "$WRAPPER works ($("$WRAPPER" --version | head -1)); nothing to do"
  exit 0
fi

# --- 3. fetch from $SUITE ----------------------------------------------------------------
distro
for cmd in apt-get apt-cache dpkg dpkg-deb python3 flock sha256sum sha512sum; do
  command -v "$cmd" >/dev/null 2>&1 || die "$cmd not found (this installer needs apt and dpkg); $MANUAL"
done
APT=${CUINTERPOSE_CRIU_APT:-$CACHE/apt}
# One installer at a time per install folder and per apt state (several `make test` may run at
# once); re-check under the locks.
mkdir -p "$CACHE" "$APT"
exec 9>"$CACHE/.install.lock"
flock 9
exec 8>"$APT/.lock"
flock 8
if cached_works; then
  say "$WRAPPER works ($("$WRAPPER" --version | head -1)); nothing to do"
  exit 0
fi
ARCH=$(dpkg --print-architecture)
case $ARCH in
  amd64) TRIPLET=x86_64-linux-gnu ;;
  arm64) TRIPLET=aarch64-linux-gnu ;;
  *) die "unsupported architecture $ARCH; $MANUAL" ;;
esac

mkdir -p "$APT/etc/sources.list.d" "$APT/etc/preferences.d" "$APT/lists/partial" \
         "$APT/cache/archives/partial" "$APT/state" "$APT/debs"
: > "$APT/status"
rm -f "$APT/etc/sources.list.d/"*

write_sources "$APT/etc/sources.list.d/$SUITE.sources" "$APT/etc/sources.list"

APT_OPTS=(
  -o "Dir::Etc::SourceList=$APT/etc/sources.list"
  -o "Dir::Etc::SourceParts=$APT/etc/sources.list.d"
  -o "Dir::Etc::Preferences=$APT/etc/preferences"
  -o "Dir::Etc::PreferencesParts=$APT/etc/preferences.d"
  -o "Dir::State=$APT/state"
  -o "Dir::State::Lists=$APT/lists"
  -o "Dir::State::status=$APT/status"
  -o "Dir::Cache=$APT/cache"
  -o "APT::Default-Release="
  -o "Acquire::Languages=none"
  -o "APT::Sandbox::User=root"
  -q
)
say "fetching the $SUITE package lists into $APT (private apt state; system apt untouched)"
if ! upd=$(apt-get "${APT_OPTS[@]}" update 2>&1); then
  # A missing <suite>-updates/-security on some mirror is not fatal if criu is found.
  say "warning: apt-get update for $SUITE reported errors (sources in $APT/etc):"
  grep -E '^(E|W):' <<<"$upd" | sed 's/^/    /' >&2 || true
fi

CANDIDATE=$(apt-cache "${APT_OPTS[@]}" policy criu | awk '/Candidate:/ {print $2}')
[[ $CANDIDATE =~ ^([0-9]+:)?([0-9]+)\. ]] \
  || die "no criu package in $SUITE (candidate: '${CANDIDATE:-none}'; sources in $APT/etc); $MANUAL"
[ "${BASH_REMATCH[2]}" -ge "$MIN_MAJOR" ] || die "$SUITE has criu $CANDIDATE, need >= $MIN_MAJOR; $MANUAL"

# The runtime closure of criu (Depends/Pre-Depends, recursively): every library it loads,
# libc6 included, comes from $SUITE so that nothing is resolved against the system's libc.
mapfile -t PKGS < <(apt-cache "${APT_OPTS[@]}" depends --recurse --no-recommends --no-suggests \
    --no-conflicts --no-breaks --no-replaces --no-enhances criu | grep -E '^[a-z0-9]' | sort -u)
[[ " ${PKGS[*]} " == *" libc6 "* ]] || die "dependency closure of criu lacks libc6: ${PKGS[*]}"
say "criu $CANDIDATE + ${#PKGS[@]} packages: ${PKGS[*]}"

# Each .deb: its file name and hash from the signed index (--print-uris; SHA256 on Debian,
# SHA512 on Ubuntu), kept as <file>.sum; one already in $APT/debs with that hash is reused,
# the others are downloaded there and checked the same way before they are unpacked.
deb_ok() {  # FILE -> 0 when $APT/debs/FILE matches its .sum
  local tool sum
  read -r tool sum <"$APT/debs/$1.sum"
  (cd "$APT/debs" && "$tool" --status -c - <<<"$sum  $1" 2>/dev/null)
}
mapfile -t URIS < <(apt-get "${APT_OPTS[@]}" --print-uris download "${PKGS[@]}")
[ ${#URIS[@]} -eq ${#PKGS[@]} ] || die "apt-get --print-uris listed ${#URIS[@]} files for ${#PKGS[@]} packages"
DEBS=() MISSING=()
for line in "${URIS[@]}"; do                 # 'URI' name_version_arch.deb size SHA256:hex
  read -r _ file _ hash <<<"$line"
  case ${hash%%:*} in
    SHA256) echo "sha256sum ${hash#*:}" >"$APT/debs/$file.sum" ;;
    SHA512) echo "sha512sum ${hash#*:}" >"$APT/debs/$file.sum" ;;
    *) die "no SHA256 or SHA512 for $file in the index: $line" ;;
  esac
  DEBS+=("$file")
  deb_ok "$file" || MISSING+=("${file%%_*}")
done
for old in "$APT"/debs/*; do                 # versions no longer in the index
  [[ " ${DEBS[*]} " == *" $(basename "${old%.sum}") "* ]] || rm -f -- "$old"
done
if [ ${#MISSING[@]} -gt 0 ]; then
  (cd "$APT/debs" && apt-get "${APT_OPTS[@]}" download "${MISSING[@]}" >/dev/null) \
    || die "apt-get download failed"
fi
say "$((${#DEBS[@]} - ${#MISSING[@]})) of ${#DEBS[@]} packages reused from $APT/debs"

STAGE=$CACHE/.stage.$$
trap 'rm -rf "$STAGE"' EXIT
rm -rf "$CACHE"/.stage.*
mkdir -p "$STAGE/root"
for file in "${DEBS[@]}"; do
  deb_ok "$file" || die "$APT/debs/$file: its hash differs from the index's ($APT/debs/$file.sum)"
  dpkg -x "$APT/debs/$file" "$STAGE/root"
done
printf '%s\n' "${DEBS[@]}" > "$STAGE/PACKAGES"
finish_install "$DISTRO $SUITE's CRIU $CANDIDATE"
