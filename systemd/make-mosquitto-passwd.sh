#!/usr/bin/env bash
# Make the Mosquitto password files for a fleet, and one credential file per box and operator.
#
#   systemd/make-mosquitto-passwd.sh OUT_DIR [--operator operator-NAME]... DEVICE_ID...
#
# Writes:
#   OUT_DIR/mosquitto.passwd           the boxes' hashed entries (mosquitto.conf.example: password_file of the
#                                      boxes' listener, /etc/mosquitto/atlas-edge.passwd)
#   OUT_DIR/operators.passwd           the operators' (password_file of the operators' listener,
#                                      /etc/mosquitto/atlas-edge-operators.passwd): a box's password is
#                                      refused there, so no box can choose a client id
#   OUT_DIR/credentials/NAME.password  the clear password of each user, mode 0600: copy a box's file to
#                                      /etc/atlas-edge/mqtt-password on that box (LoadCredential=mqtt-password:
#                                      in atlas-edge.service; config: mqtt.username: DEVICE_ID,
#                                      mqtt.password: cred:mqtt-password)
# Idempotent: a user whose credential file exists keeps its password, so running it again with one more
# device adds that device and changes nobody else's password. Passwords are 32 random characters from
# /dev/urandom and never appear on a command line: the clear file is hashed in place with
# `mosquitto_passwd -U` (package: mosquitto, or mosquitto-clients on some distributions).
# Operators are named operator-<name>, one per person (systemd/mosquitto-acl.example has a `user` block for
# each; it ships with operator-admin); with no --operator, operator-admin is made. No device may be so named.
set -euo pipefail

die() { echo "make-mosquitto-passwd.sh: $*" >&2; exit 2; }

[ $# -ge 2 ] || die "usage: $0 OUT_DIR [--operator operator-NAME]... DEVICE_ID..."
OUT=$1
shift
OPERATORS=()
DEVICES=()
while [ $# -gt 0 ]; do
    case "$1" in
        --operator) [ $# -ge 2 ] || die "--operator needs a name"; OPERATORS+=("$2"); shift 2 ;;
        -*) die "unknown option $1" ;;
        *) DEVICES+=("$1"); shift ;;
    esac
done
[ ${#DEVICES[@]} -ge 1 ] || die "name at least one DEVICE_ID"
[ ${#OPERATORS[@]} -ge 1 ] || OPERATORS=(operator-admin)

PASSWD_TOOL=$(command -v mosquitto_passwd || true)
[ -n "$PASSWD_TOOL" ] || die "mosquitto_passwd not found: install it (apt-get install mosquitto)"

for name in "${OPERATORS[@]}" "${DEVICES[@]}"; do
    # a username ends up in topics through the ACL's %u: the same rule as the daemon's device_id
    case "$name" in
        ""|*/*|*+*|*"#"*|*:*|*[[:space:]]*|'$'*) die "bad user name '$name' (no / + # : spaces or leading \$)" ;;
    esac
done
for name in "${DEVICES[@]}"; do
    # operator-* are the operators' accounts (a device so named would get an operator's rights and client ids);
    # 'group' is the topic level of group commands (a device so named could write every group's command topics)
    case "$name" in
        operator|operator-*|group) die "device name '$name' is reserved (operator, operator-*, group)" ;;
    esac
done
for op in "${OPERATORS[@]}"; do
    case "$op" in
        operator-?*) ;;
        *) die "operator name '$op' must be operator-<name> (the ACL's and the client ids' rule)" ;;
    esac
done

umask 077
mkdir -p "$OUT/credentials"
CLEAR=""
trap 'rm -f "$CLEAR"' EXIT

# write_passwd FILE USER...: FILE holds the hashed entries of exactly these users
write_passwd() {
    local file=$1 name cred password
    shift
    CLEAR=$(mktemp "$OUT/.passwd.XXXXXX")
    for name in "$@"; do
        cred="$OUT/credentials/$name.password"
        if [ ! -s "$cred" ]; then
            # 32 characters of [A-Za-z0-9] (~190 bits) from the kernel's CSPRNG; no pipe is cut short, so
            # pipefail never sees a SIGPIPE
            password=""
            while [ ${#password} -lt 32 ]; do
                password+=$(head -c 256 /dev/urandom | LC_ALL=C tr -dc 'A-Za-z0-9')
            done
            printf '%s' "${password:0:32}" >"$cred"
        fi
        printf '%s:%s\n' "$name" "$(cat "$cred")" >>"$CLEAR"
    done
    "$PASSWD_TOOL" -U "$CLEAR"
    chmod 0600 "$CLEAR"
    mv "$CLEAR" "$OUT/$file"
    CLEAR=""
}

write_passwd mosquitto.passwd "${DEVICES[@]}"
write_passwd operators.passwd "${OPERATORS[@]}"
trap - EXIT
echo "wrote $OUT/mosquitto.passwd (${#DEVICES[@]} device(s)), $OUT/operators.passwd (${#OPERATORS[@]} operator(s))" \
    "and $OUT/credentials/"
