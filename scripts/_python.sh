# Sourced by scripts/test and scripts/demo: chooses the Python they install into and run with ($PY).
#
# - A virtual environment is active ($VIRTUAL_ENV): its python3. The person chose where packages go.
# - Else, the python3 on PATH is "externally managed" (PEP 668: Debian's and Ubuntu's system Python,
#   whose pip refuses to install): a project virtual environment, .venv at the repository's root,
#   created on first use and reused after. No sudo, no --break-system-packages.
# - Else (pyenv, conda, a python.org or Homebrew install: pip installs there): that python3 itself.
#
# Why not always a .venv: pip's own rule (PEP 668) is what separates the Python a package manager
# owns from one the person owns; following it keeps an existing pyenv or conda set-up working as
# before and only steps in where installing would fail. ENGINE_VENV=1 asks for the .venv in every
# case (ENGINE_VENV=0 never); ENGINE_VENV_DIR moves it.

engine_python() {
    local base="${PYTHON:-python3}" mode="${ENGINE_VENV:-auto}" venv="${ENGINE_VENV_DIR:-$PWD/.venv}"
    if ! command -v "$base" >/dev/null 2>&1; then
        echo "error: $base not found; install Python >= 3.10 (e.g. apt-get install python3 python3-venv)" >&2
        return 1
    fi
    case "$mode" in
        0|no|never) PY="$base"; return 0 ;;
        1|yes|always) ;;
        auto)
            if [ -n "${VIRTUAL_ENV:-}" ] || ! "$base" - <<'PYEOF'
import os, sys, sysconfig
in_venv = sys.prefix != getattr(sys, "base_prefix", sys.prefix)
marker = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")
sys.exit(0 if not in_venv and os.path.isfile(marker) else 1)
PYEOF
            then
                PY="$base"
                return 0
            fi ;;
        *) echo "error: ENGINE_VENV=$mode: expected auto (default), 1 (always a .venv) or 0 (never)" >&2
           return 1 ;;
    esac
    if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "" 2>/dev/null; then
        echo "creating the project's virtual environment: $venv (from $(command -v "$base"))" >&2
        if ! "$base" -m venv "$venv"; then
            echo "error: could not create $venv: install the venv module (apt-get install python3-venv)," \
                 "or activate a virtual environment of your own and run this again" >&2
            return 1
        fi
    fi
    PY="$venv/bin/python"
    echo "using $PY (engine and its tools are installed there; 'source $venv/bin/activate' to use them)" >&2
}
