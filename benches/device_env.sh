# Sourced by benches/device_check*.sh (needs PY and LOGS): kvcore's binary from the wheel
# KVCORE_WHEEL (a glob; only kvcore/_kvcore*.so is taken, into python/kvcore/, so the checked-out
# Python code runs with it), then the environment's versions and GPU into $LOGS/device_env.log;
# sets HAVE_KVCORE (1: kvcore imports).
if [[ -n "${KVCORE_WHEEL:-}" ]]; then
    $PY - "$KVCORE_WHEEL" <<'PY'
import glob, sys, zipfile
from pathlib import Path
wheels = [Path(w) for w in sorted(glob.glob(sys.argv[1]))]
if not wheels:
    sys.exit(f"KVCORE_WHEEL={sys.argv[1]} matches no file")
with zipfile.ZipFile(wheels[-1]) as z:
    name = next(n for n in z.namelist() if n.startswith("kvcore/_kvcore") and n.endswith(".so"))
    Path("python/kvcore/_kvcore.abi3.so").write_bytes(z.read(name))
    print(f"kvcore binary from {wheels[-1].name}: {name}")
PY
fi

$PY - <<'PY' 2>&1 | tee "$LOGS/device_env.log"
import os, torch, triton, transformers
print(f"python torch {torch.__version__} triton {triton.__version__} "
      f"transformers {transformers.__version__} cuda {torch.version.cuda} cpus {os.cpu_count()}")
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    print(f"gpu {props.name} sms {props.multi_processor_count} memory {props.total_memory >> 30} GiB")
else:
    print("gpu none (the cuda tests skip; only --dry-run makes sense here)")
try:
    import kvcore
    print(f"kvcore {kvcore.__version__} (binary imports)")
except Exception as e:  # no wheel given: the engine stages cannot run
    print(f"kvcore does not import: {e}")
PY
HAVE_KVCORE=$(grep -c "binary imports" "$LOGS/device_env.log")
