/*
 * ops.h: the op layer (above phase_ops.h): what the control endpoint (control.c) calls.
 * ops.c admits a request against the CUI_OPS table (protocol.h), runs its op function and
 * moves the phase; it also answers INSPECT.
 */
#ifndef CUI_OPS_H
#define CUI_OPS_H

#include "phase_ops.h"

/* Runs one request on the control worker. Fills `res`; the caller sends the reply. */
CUI_HIDDEN void cui_run_op(const struct cui_request *req, struct cui_op_result *res);

#endif
