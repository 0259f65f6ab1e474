MPIRUN_PID=$!
# ---- the end of the job: SIGTERM, SIGUSR1 or Ctrl-C to this script reach every rank (through
# mpirun), which finishes its step, saves a checkpoint and exits 75 ("stopped cleanly, resume me");
# run this script again to continue (--resume auto).
STATUS=0
while :; do
    INTERRUPTED=0
    wait "${MPIRUN_PID}" && STATUS=0 || STATUS=$?
    [ "${INTERRUPTED}" = 1 ] || break    # mpirun ended (else a signal interrupted the wait)
done
if [ "${STATUS}" -eq 75 ]; then
    echo "axo4d job: training stopped cleanly (exit 75): run this script again to continue from its checkpoint"
fi
exit "${STATUS}"
