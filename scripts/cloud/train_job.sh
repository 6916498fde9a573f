#!/usr/bin/env bash
# Run one training command as a detached job on a cloud host (tpu_vm.py / gpu_node.py
# start it with `setsid nohup ... >> LOG 2>&1 &`, so a dropped ssh connection does not
# end it), and keep its results in a bucket.
#
#   scripts/cloud/train_job.sh <train command...>
#
# Settings (environment):
#   SBM_JOB_PIDFILE      file that gets the trainer's pid (`kill -TERM $(cat it)` stops it
#                        the way a preemption does: save, then exit 75)
#   SBM_JOB_DATA_BUCKET  gs:// TFDS dir to copy to SBM_JOB_DATA_DIR first (rsync: only
#                        what is missing is copied, so a rerun is quick)
#   SBM_JOB_DATA_DIR
#   SBM_JOB_BUCKET_DIR   gs://bucket/path of the run: the output dir every host shares
#   SBM_JOB_RUN_DIR      local dir the trainer gets as --output_dir (must be the value of
#                        the command's --output_dir)
#   SBM_JOB_MOUNT        where gs://bucket is mounted with Cloud Storage FUSE
#   SBM_JOB_SYNC_EVERY   seconds between metric copies to the bucket (default 120)
#
# With SBM_JOB_BUCKET_DIR: the bucket is mounted (gcsfuse) unless it already is;
# RUN_DIR/checkpoints (and RUN_DIR/nonfinite) become links into the mount, so orbax
# writes the checkpoints straight to the bucket, where every host of a multi-host run
# sees the same ones; the rest of the run dir (metrics.jsonl, metrics.csv, tensorboard/,
# config.json, summary.json) is first copied back from the bucket (a rerun after a
# preemption continues them) and then copied to it every SBM_JOB_SYNC_EVERY seconds and
# when the trainer exits. The trainer itself resumes from the newest checkpoint it finds.
#
# Signals: SIGTERM / SIGINT to this script do not reach the trainer (a preemption or
# shutdown signals every process itself, and the trainer treats a second signal as
# "stop now, without saving"); this script waits for the trainer, copies the results
# and exits with the trainer's status.
set -uo pipefail

exec 3>&1  # the job's log, also where a trap's message goes while a copy runs quietly
log() { echo "[train_job $(date -u +%H:%M:%S)] $*" >&3; }

if [ "$#" -eq 0 ]; then
  echo "usage: $0 <train command...>" >&2
  exit 2
fi

if [ -n "${SBM_JOB_DATA_BUCKET:-}" ]; then
  log "copying ${SBM_JOB_DATA_BUCKET} -> ${SBM_JOB_DATA_DIR}"
  mkdir -p "${SBM_JOB_DATA_DIR}"
  gcloud storage rsync --recursive "${SBM_JOB_DATA_BUCKET}" "${SBM_JOB_DATA_DIR}" || exit 1
fi

sync_up() { :; }
if [ -n "${SBM_JOB_BUCKET_DIR:-}" ]; then
  bucket_path="${SBM_JOB_BUCKET_DIR#gs://}"
  bucket="${bucket_path%%/*}"
  path="${bucket_path#"$bucket"}"
  path="${path#/}"
  run_dir="${SBM_JOB_RUN_DIR}"
  if ! mountpoint -q "${SBM_JOB_MOUNT}"; then
    log "mounting gs://${bucket} at ${SBM_JOB_MOUNT}"
    mkdir -p "${SBM_JOB_MOUNT}"
    # --rename-dir-limit: orbax finalizes a step by renaming its temporary directory.
    gcsfuse --implicit-dirs --rename-dir-limit=200000 "${bucket}" "${SBM_JOB_MOUNT}" || exit 1
  fi
  shared="${SBM_JOB_MOUNT}/${path}"
  mkdir -p "${run_dir}" "${shared}/checkpoints" "${shared}/nonfinite" || exit 1
  log "restoring metrics from ${SBM_JOB_BUCKET_DIR} (none on a first run)"
  gcloud storage rsync --recursive --exclude='^(checkpoints|nonfinite|logs)/' \
    "${SBM_JOB_BUCKET_DIR}" "${run_dir}" 2>/dev/null || true
  for name in checkpoints nonfinite; do
    ln -sfn "${shared}/${name}" "${run_dir}/${name}" || exit 1
  done
  sync_up() {
    gcloud storage rsync --recursive --ignore-symlinks "${run_dir}" "${SBM_JOB_BUCKET_DIR}"
  }
fi

log "starting: $*"
"$@" &
trainer=$!
if [ -n "${SBM_JOB_PIDFILE:-}" ]; then
  echo "${trainer}" > "${SBM_JOB_PIDFILE}"
fi
trap 'log "got a signal: waiting for the trainer to save and exit"' TERM INT HUP
every="${SBM_JOB_SYNC_EVERY:-120}"
waited=0
while kill -0 "${trainer}" 2>/dev/null; do
  sleep 1 &
  wait $! 2>/dev/null
  waited=$((waited + 1))
  if [ "${waited}" -ge "${every}" ] && kill -0 "${trainer}" 2>/dev/null; then
    sync_up >/dev/null 2>&1 || log "copy to the bucket failed; trying again later"
    waited=0
  fi
done
wait "${trainer}"
status=$?
log "trainer exited with status ${status}"
sync_up || log "copy to the bucket failed"
exit "${status}"
