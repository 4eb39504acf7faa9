"""One session of a Run in its process (a script, or a notebook kernel that outlives it): the session itself (the
run dir opened, the checkpoint loaded, the loop and its reporters), the open runs and how a loop was left, the same
fresh start on every run of a cell, the code identity and the session's end."""
