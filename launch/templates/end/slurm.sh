SRUN_PID=$!
# ---- the end of the job ({{signal_why}}) ----
# Slurm sends USR1 to this script {{signal_s}} s before the time limit (--signal=B:USR1@{{signal_s}}); the
# trap passes it to srun, which passes it to every rank: each finishes its step, saves a checkpoint
# and exits 75 ("stopped cleanly, resume me"). The job then requeues itself (same job id, same
# RUN_DIR) and the next run continues with --resume auto. Training that finished (0) or failed for
# a reason a restart would meet again (2: bad input; 1: a failed run) ends the job: no requeue.
STATUS=0
while :; do
    INTERRUPTED=0
    wait "${SRUN_PID}" && STATUS=0 || STATUS=$?
    [ "${INTERRUPTED}" = 1 ] || break    # srun ended (else a signal interrupted the wait)
done
MAX_REQUEUES="${MAX_REQUEUES:-50}"
if [ "${STATUS}" -eq 75 ] && [ "${SLURM_RESTART_COUNT:-0}" -lt "${MAX_REQUEUES}" ]; then
    echo "axo4d job: training stopped cleanly (exit 75): requeueing job ${SLURM_JOB_ID} (restart $(( ${SLURM_RESTART_COUNT:-0} + 1 )) of at most ${MAX_REQUEUES})"
    scontrol requeue "${SLURM_JOB_ID}"
elif [ "${STATUS}" -eq 75 ]; then
    echo "axo4d job: training stopped cleanly, but MAX_REQUEUES=${MAX_REQUEUES} requeues are done: resubmit to continue" >&2
elif [ "${STATUS}" -eq 0 ]; then
    echo "axo4d job: training finished"
else
    echo "axo4d job: training failed (exit status ${STATUS}): not requeueing (see the error above)" >&2
fi
exit "${STATUS}"
