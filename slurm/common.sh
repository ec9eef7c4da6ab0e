# common.sh - helpers shared by serve.slurm, train.slurm and grpo.slurm (sourced, never run).
#
# Everything about the run (files, sbatch options, commands) comes from the recipe through
# `python -m open_r1_ext.cli slurm-env RECIPE` (open_r1_ext/slurm_plan.py); nothing here reads YAML.
# Set PYTHON to the interpreter of the environment (default: `python` on PATH; jobs inherit the submit shell's PATH).

PYTHON=${PYTHON:-python}
SCRIPT_NAME=${SCRIPT_NAME:-$(basename "$0")}  # set by each script (under sbatch, $0 is a spool copy)

log() { printf '[%s %s] %s\n' "$(date +%H:%M:%S)" "$SCRIPT_NAME" "$*" >&2; }

die() {
    log "ERROR: $*"
    exit 1
}

# parse_args "$@": RECIPE, ROLE (--role, default server) and SET_ARGS (each --set K=V as --set=K=V).
parse_args() {
    RECIPE="" ROLE=server SET_ARGS=()
    while (($#)); do
        case $1 in
            --set) (($# >= 2)) || die "--set needs SECTION.KEY=VALUE"; SET_ARGS+=("--set=$2"); shift 2 ;;
            --set=*) SET_ARGS+=("$1"); shift ;;
            --role) (($# >= 2)) || die "--role needs server or ref-server"; ROLE=$2; shift 2 ;;
            --role=*) ROLE=${1#--role=}; shift ;;
            -h|--help) sed -n '2,/^$/p' "$SLURM_DIR/$SCRIPT_NAME" >&2; exit 0 ;;
            -*) die "unknown option $1 (usage: $SCRIPT_NAME RECIPE [--set SECTION.KEY=VALUE ...])" ;;
            *) [[ -z $RECIPE ]] || die "one recipe only (got $RECIPE and $1)"; RECIPE=$1; shift ;;
        esac
    done
    [[ -n $RECIPE ]] || die "usage: $SCRIPT_NAME RECIPE [--set SECTION.KEY=VALUE ...]"
}

# load_plan: validate the recipe and define the run's variables (RUN_DIR, SERVER_ROLES, <ROLE>_SBATCH, ...).
load_plan() {
    command -v "$PYTHON" >/dev/null || die "$PYTHON not found: activate the project's environment or set PYTHON"
    local plan
    plan=$("$PYTHON" -m open_r1_ext.cli slurm-env "$RECIPE" "${SET_ARGS[@]}") \
        || die "recipe $RECIPE is not valid (see above); nothing started"
    eval "$plan"
}

# role_var ROLE: the prefix of a job's variables, e.g. ref-server -> REF_SERVER.
role_var() {
    local var=${1^^}
    echo "${var//-/_}"
}

# first_node: the first host of this job's allocation (SGLang's and accelerate's rendezvous).
first_node() { scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1; }

# job_state ID: squeue's state while queued or running, then scontrol's (for MinJobAge), else GONE.
job_state() {
    local state
    state=$(squeue -h -j "$1" -o %T 2>/dev/null | head -n 1)
    [[ -n $state ]] || state=$(scontrol show job "$1" 2>/dev/null | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p')
    echo "${state:-GONE}"
}

# job_alive ID: whether the job is still queued or running (squeue lists it). When squeue fails for another
# reason than an unknown job id (a busy controller), the job counts as alive: a run is never cut short on a hiccup.
job_alive() {
    local out
    if out=$(squeue -h -j "$1" -o %T 2>&1); then
        [[ -n $out ]]
    else
        [[ $out != *"Invalid job id"* ]]
    fi
}

# record MESSAGE: one line in the run's status log (as the Python launcher writes it) and on stderr.
record() {
    printf '%s %s\n' "$(date -Iseconds)" "$*" >>"$STATUS_FILE"
    log "$*"
}

# jobs_value KEY: a value of the run's jobs file (SERVER_JOB, REF_SERVER_JOB, TRAINER_JOB), empty if unset.
jobs_value() { [[ -f $JOBS_FILE ]] && sed -n "s/^$1=//p" "$JOBS_FILE" | tail -n 1 || true; }
