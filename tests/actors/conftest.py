"""tests/actors mirrors actors/: engines/, envs/, tasks/, and the actor's own tests here. The helpers in this
folder are user code imported by name, as a module on sys.path would be (`scripted_envs:ScriptedEnv`,
`hanging_user_code:spin_reward`), by the tests of every room: this folder goes on sys.path for every test below it
(pytest's default import mode puts only a test file's own folder there), and a worker process started by a test
gets the caller's sys.path."""
import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
