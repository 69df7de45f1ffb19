#!/bin/sh
# install-agent.sh: make this host a llmgw GPU host, in one idempotent run.
#
#   sudo deploy/install-agent.sh --node gpu-a1 --nats-host nats.internal:4222 \
#       --nats-ca ca.pem --password-file gpu-a1.pw
#
# It makes what deploy/systemd/llmgw-agent@.service assumes, and nothing else:
#   1. the system user and group llmgw, in the GPU device groups the host has (video,
#      render), so the agent and its model servers open /dev/nvidia* and NVML;
#   2. the directories: /opt/llmgw (root, 0755), /etc/llmgw (root, 0755),
#      /etc/llmgw/nats (root:llmgw, 0750), /var/lib/llmgw and /var/lib/llmgw/hf
#      (llmgw, 0750: the agent's state, the servers' logs, the model weights);
#   3. the venv /opt/llmgw/.venv with llmgw and its `gpu` extra (nvidia-ml-py), from
#      --source (this checkout by default); reinstalled only when the source changed;
#   4. the unit, deploy/systemd/llmgw-agent@.service as shipped, in /etc/systemd/system;
#   5. the credentials the unit reads (EnvironmentFile=/etc/llmgw/agent.env, root, 0600):
#      LLMGW_NATS=tls://NODE:PASSWORD@HOST and LLMGW_NATS_CA=/etc/llmgw/nats/ca.pem.
#      The password is read from --password-file (the node's line of the passwords file
#      deploy/nats/users.py keeps, or the password alone), never from the command line
#      (`ps` shows it to every local user), and never printed. An agent.env already
#      there is kept as it is (its mode is still made 0600).
# Run it again at any time: what is already as it should be is left alone, and the last
# line says what changed ("nothing to change" on a host already installed).
#
# --root DIR installs into DIR as if it were / (a staging tree, a test): there the user
# and groups are written into DIR/etc/passwd and DIR/etc/group, not with useradd, and
# systemd is not told. --no-systemd leaves out the unit and the credentials (a container
# image: the Containerfile; Kubernetes gives the agent its URL from a Secret).
set -eu

PROG=install-agent.sh
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=/
NODE=
NATS_HOST=
NATS_CA=
PASSWORD_FILE=
SOURCE=$(dirname "$HERE")
PYTHON=${PYTHON:-python3}
SYSTEMD=1
EXTRA=gpu
CHANGES=0

usage() {
	sed -n '2,/^set -eu/p' "$0" | sed '$d; s/^# \{0,1\}//'
	cat <<EOF
options:
  --root DIR           install into DIR as if it were / (default /)
  --node NAME          this host's node name (default: hostname -s)
  --nats-host H:P      the broker every agent reaches (default nats.internal:4222)
  --nats-ca FILE       the CA that signed the broker's certificate (PEM), copied to
                       /etc/llmgw/nats/ca.pem
  --password-file FILE the node's broker password (NODE=PASSWORD or the password alone)
  --source DIR         the llmgw source to install (default: this checkout)
  --python PY          the interpreter the venv is made with (default python3)
  --no-gpu             leave out the gpu extra (nvidia-ml-py): a host with no GPU
  --no-systemd         no unit and no credentials file (a container image)
EOF
}

die() {
	echo "$PROG: $*" >&2
	exit 1
}

while [ $# -gt 0 ]; do
	case $1 in
	--root) ROOT=${2:?--root needs a directory}; shift 2 ;;
	--node) NODE=${2:?--node needs a name}; shift 2 ;;
	--nats-host) NATS_HOST=${2:?--nats-host needs HOST:PORT}; shift 2 ;;
	--nats-ca) NATS_CA=${2:?--nats-ca needs a file}; shift 2 ;;
	--password-file) PASSWORD_FILE=${2:?--password-file needs a file}; shift 2 ;;
	--source) SOURCE=${2:?--source needs a directory}; shift 2 ;;
	--python) PYTHON=${2:?--python needs an interpreter}; shift 2 ;;
	--no-gpu) EXTRA=; shift ;;
	--no-systemd) SYSTEMD=0; shift ;;
	-h | --help) usage; exit 0 ;;
	--password | --password=*) die "a password on the command line is visible to every local user (ps): put it in a file and pass --password-file FILE" ;;
	*) die "unknown option $1 (see --help)" ;;
	esac
done

ROOT=${ROOT%/}
[ -n "$ROOT" ] || ROOT=
[ -z "$ROOT" ] || [ -d "$ROOT" ] || die "--root $ROOT: no such directory"
[ -f "$SOURCE/pyproject.toml" ] || die "--source $SOURCE: no pyproject.toml there (not an llmgw checkout)"
[ -z "$NATS_CA" ] || [ -r "$NATS_CA" ] || die "--nats-ca $NATS_CA: cannot read it"
[ -z "$PASSWORD_FILE" ] || [ -r "$PASSWORD_FILE" ] || die "--password-file $PASSWORD_FILE: cannot read it"
[ -n "$NODE" ] || NODE=$(hostname -s 2>/dev/null || hostname)
[ -n "$NATS_HOST" ] || NATS_HOST=nats.internal:4222
case $NODE in *[!A-Za-z0-9._-]* | "") die "--node $NODE: use letters, digits, '.', '_' and '-'" ;; esac
# The credentials name the CA (LLMGW_NATS_CA=/etc/llmgw/nats/ca.pem): written without
# one, the agent could never verify the broker's certificate, and would not start.
if [ "$SYSTEMD" -eq 1 ] && [ -n "$PASSWORD_FILE" ] && [ ! -f "$ROOT/etc/llmgw/agent.env" ] &&
	[ -z "$NATS_CA" ] && [ ! -f "$ROOT/etc/llmgw/nats/ca.pem" ]; then
	die "--nats-ca FILE is needed: the agent speaks TLS to the broker and checks its certificate against /etc/llmgw/nats/ca.pem, which is not there (pass the CA that signed the broker's certificate)"
fi

changed() {
	CHANGES=$((CHANGES + 1))
	echo "  changed: $*"
}
ok() { echo "  ok: $*"; }

AS_ROOT=0
[ "$(id -u)" -eq 0 ] && AS_ROOT=1

# ---------------------------------------------------------------- 1. user and groups

# In a --root tree the account databases are plain files; on the host itself, useradd
# and usermod keep them (shadow, nscd and all).
staged_user() {
	passwd=$ROOT/etc/passwd group=$ROOT/etc/group
	mkdir -p "$ROOT/etc"
	[ -f "$passwd" ] || : >"$passwd"
	[ -f "$group" ] || : >"$group"
	if ! grep -q '^llmgw:' "$group"; then
		gid=$(awk -F: 'BEGIN{g=999} $3>=g && $3<1000 {g=$3+1} END{print g}' "$group")
		echo "llmgw:x:$gid:" >>"$group"
		changed "group llmgw ($gid)"
	fi
	gid=$(awk -F: '$1=="llmgw"{print $3}' "$group")
	if ! grep -q '^llmgw:' "$passwd"; then
		uid=$(awk -F: 'BEGIN{u=999} $3>=u && $3<1000 {u=$3+1} END{print u}' "$passwd")
		echo "llmgw:x:$uid:$gid:llmgw agent:/var/lib/llmgw:/usr/sbin/nologin" >>"$passwd"
		changed "user llmgw ($uid)"
	else
		ok "user llmgw"
	fi
	for g in video render; do
		line=$(grep "^$g:" "$group" || true)
		[ -n "$line" ] || continue
		members=${line##*:}
		case ",$members," in
		*,llmgw,*) ok "llmgw in group $g" ;;
		*)
			new=${members:+$members,}llmgw
			awk -F: -v g="$g" -v m="$new" 'BEGIN{OFS=":"} $1==g{$4=m} {print}' "$group" >"$group.new"
			mv "$group.new" "$group"
			changed "llmgw in group $g"
			;;
		esac
	done
}

host_user() {
	if ! getent group llmgw >/dev/null; then
		groupadd --system llmgw
		changed "group llmgw"
	fi
	if ! getent passwd llmgw >/dev/null; then
		useradd --system --gid llmgw --home-dir /var/lib/llmgw --no-create-home \
			--shell /usr/sbin/nologin --comment "llmgw agent" llmgw
		changed "user llmgw"
	else
		ok "user llmgw"
	fi
	for g in video render; do
		getent group "$g" >/dev/null || continue
		if id -nG llmgw | tr ' ' '\n' | grep -qx "$g"; then
			ok "llmgw in group $g"
		else
			usermod -a -G "$g" llmgw
			changed "llmgw in group $g"
		fi
	done
}

echo "$PROG: user and groups"
if [ -z "$ROOT" ]; then
	[ "$AS_ROOT" -eq 1 ] || die "making the user llmgw needs root (or --root DIR for a staging tree)"
	host_user
else
	staged_user
fi
LLMGW_UID=$(awk -F: '$1=="llmgw"{print $3}' "$ROOT/etc/passwd")
LLMGW_GID=$(awk -F: '$1=="llmgw"{print $3}' "$ROOT/etc/group")

# ---------------------------------------------------------------- 2. directories

# owner_of PATH: "UID:GID" of PATH, numeric (a --root tree's users are not the host's).
owner_of() { stat -c %u:%g "$1"; }
mode_of() { stat -c %a "$1"; }

# place PATH MODE UID GID: a directory, or a file already there, with that mode and
# owner. Ownership is set when running as root (a staging tree made by a user keeps its
# maker's).
place() {
	path=$1 mode=$2 uid=$3 gid=$4 what=
	if [ ! -e "$path" ]; then
		mkdir -p "$path"
		what="made"
	fi
	if [ "$(mode_of "$path")" != "$mode" ]; then
		chmod "$mode" "$path"
		what=${what:-"mode $mode"}
	fi
	if [ "$AS_ROOT" -eq 1 ] && [ "$(owner_of "$path")" != "$uid:$gid" ]; then
		chown "$uid:$gid" "$path"
		what=${what:-"owner $uid:$gid"}
	fi
	if [ -n "$what" ]; then changed "${path#"$ROOT"} ($what)"; else ok "${path#"$ROOT"}"; fi
}

# put SRC DEST MODE: DEST a copy of SRC, root's, with MODE; left alone when it is one.
put() {
	src=$1 dest=$2 mode=$3
	if [ -f "$dest" ] && cmp -s "$src" "$dest"; then
		if [ "$(mode_of "$dest")" = "$mode" ]; then
			ok "${dest#"$ROOT"}"
			return 1
		fi
		chmod "$mode" "$dest"
		changed "${dest#"$ROOT"} (mode $mode)"
		return 0
	fi
	mkdir -p "$(dirname "$dest")"
	cp "$src" "$dest.new"
	chmod "$mode" "$dest.new"
	[ "$AS_ROOT" -eq 0 ] || chown 0:0 "$dest.new"
	mv "$dest.new" "$dest"
	changed "${dest#"$ROOT"}"
}

echo "$PROG: directories"
place "$ROOT/opt/llmgw" 755 0 0
place "$ROOT/etc/llmgw" 755 0 0
place "$ROOT/etc/llmgw/nats" 750 0 "$LLMGW_GID"
place "$ROOT/var/lib/llmgw" 750 "$LLMGW_UID" "$LLMGW_GID"
place "$ROOT/var/lib/llmgw/hf" 750 "$LLMGW_UID" "$LLMGW_GID"
if [ -n "$NATS_CA" ]; then
	put "$NATS_CA" "$ROOT/etc/llmgw/nats/ca.pem" 644 || true
fi

# ---------------------------------------------------------------- 3. the venv

# The stamp is what was installed: the source's files and the extra. The same stamp,
# and the venv's llmgw still runs: nothing to do.
VENV=$ROOT/opt/llmgw/.venv
STAMP=$VENV/llmgw-source.sha256
stamp() {
	(
		cd "$SOURCE"
		find pyproject.toml schemas services deploy/systemd -type f \
			! -name '*.pyc' ! -path '*/__pycache__/*' | LC_ALL=C sort | xargs sha256sum
		echo "extra=$EXTRA"
	) | sha256sum | cut -d' ' -f1
}

echo "$PROG: venv"
want=$(stamp)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && "$VENV/bin/llmgw" --help >/dev/null 2>&1; then
	ok "${VENV#"$ROOT"} (llmgw${EXTRA:+[$EXTRA]} as in $SOURCE)"
else
	[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
	spec=$SOURCE${EXTRA:+[$EXTRA]}
	# A copy, not an editable install: the venv must not depend on the checkout.
	if ! "$VENV/bin/pip" install --quiet --disable-pip-version-check "$spec" >"$VENV/pip.log" 2>&1; then
		die "pip install $spec failed; its output is in ${VENV#"$ROOT"}/pip.log"
	fi
	echo "$want" >"$STAMP"
	changed "${VENV#"$ROOT"} (llmgw${EXTRA:+[$EXTRA]} from $SOURCE)"
fi

# ---------------------------------------------------------------- 4. and 5. systemd

if [ "$SYSTEMD" -eq 1 ]; then
	echo "$PROG: unit and credentials"
	UNIT=$ROOT/etc/systemd/system/llmgw-agent@.service
	unit_changed=0
	put "$SOURCE/deploy/systemd/llmgw-agent@.service" "$UNIT" 644 && unit_changed=1

	ENVFILE=$ROOT/etc/llmgw/agent.env
	if [ -f "$ENVFILE" ]; then
		if [ "$(mode_of "$ENVFILE")" != 600 ]; then
			chmod 600 "$ENVFILE"
			changed "/etc/llmgw/agent.env (mode 600: it holds the broker password)"
		else
			ok "/etc/llmgw/agent.env (kept as it is)"
		fi
	elif [ -n "$PASSWORD_FILE" ]; then
		# The node's line (NODE=PASSWORD), else the file's only line is the password.
		pw=$(sed -n "s/^$NODE=//p" "$PASSWORD_FILE" | head -n 1)
		[ -n "$pw" ] || pw=$(grep -v '^[[:space:]]*#' "$PASSWORD_FILE" | grep -v = | head -n 1 || true)
		[ -n "$pw" ] || die "--password-file $PASSWORD_FILE: no line $NODE=PASSWORD and no bare password"
		case $pw in change-me*) die "--password-file $PASSWORD_FILE: the password of $NODE is a placeholder (change-me...): use the one deploy/nats/users.py made" ;; esac
		umask 077
		{
			echo "# Written by install-agent.sh; read by llmgw-agent@.service (EnvironmentFile=)."
			echo "LLMGW_NATS=tls://$NODE:$pw@$NATS_HOST"
			echo "LLMGW_NATS_CA=/etc/llmgw/nats/ca.pem"
		} >"$ENVFILE.new"
		chmod 600 "$ENVFILE.new"
		[ "$AS_ROOT" -eq 0 ] || chown 0:0 "$ENVFILE.new"
		mv "$ENVFILE.new" "$ENVFILE"
		changed "/etc/llmgw/agent.env (tls://$NODE:***@$NATS_HOST, mode 600)"
	else
		echo "  missing: /etc/llmgw/agent.env: pass --password-file FILE (the node's password) to write it; the unit does not start without it"
	fi
	if [ -z "$ROOT" ] && [ "$unit_changed" -eq 1 ] && command -v systemctl >/dev/null; then
		systemctl daemon-reload
	fi
fi

if [ "$CHANGES" -eq 0 ]; then
	echo "$PROG: nothing to change"
else
	echo "$PROG: $CHANGES change(s)"
fi
if [ "$SYSTEMD" -eq 1 ]; then
	echo "$PROG: start it with: systemctl enable --now llmgw-agent@$NODE"
fi
