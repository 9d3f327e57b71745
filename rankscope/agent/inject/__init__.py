"""Loading a library (the CUPTI shim) into a running process that did not opt in: ptrace one thread, call the
loader's dlopen and the library's entry point in it, put it back exactly as it was. Opt-in per use
(`--inject-shim`): it changes the process."""
