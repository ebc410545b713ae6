# The interpreter driver for R contexts (crates/server/src/interpreter.rs).
# Started as `stdbuf -oL Rscript --vanilla -e 'eval(parse(text = commandArgs(TRUE)[1]))' DRIVER`
# (line-buffered stdout, so output streams while a cell runs); the first stdin
# line is a per-process nonce, each later line one run {"id","code"}. Code is
# evaluated expression by expression in the global environment, so state
# persists. Protocol lines go to stdout as `NONCE {json}`; what the code
# prints goes there too as plain lines (the server takes them as stdout);
# messages and warnings become `stderr` events. SIGINT raises an `interrupt`
# condition, which stops the cell and keeps the state; the driver holds
# interrupts everywhere but in the code's evaluation, and drops one that
# came between runs.
local({
  con <- file("stdin", "r")
  nonce <- readLines(con, n = 1)
  esc <- function(s) {
    s <- enc2utf8(paste(s, collapse = "\n"))
    s <- gsub("\\", "\\\\", s, fixed = TRUE)
    s <- gsub("\"", "\\\"", s, fixed = TRUE)
    s <- gsub("\n", "\\n", s, fixed = TRUE)
    s <- gsub("\r", "\\r", s, fixed = TRUE)
    s <- gsub("\t", "\\t", s, fixed = TRUE)
    s <- gsub("[\001-\037]", "?", s, useBytes = TRUE)
    paste0("\"", s, "\"")
  }
  obj <- function(...) {
    kv <- list(...)
    parts <- vapply(names(kv), function(k) {
      v <- kv[[k]]
      paste0(esc(k), ":", if (is.logical(v)) tolower(as.character(v)) else if (is.character(v)) esc(v) else v)
    }, "")
    paste0("{", paste(parts, collapse = ","), "}")
  }
  emit <- function(json) suspendInterrupts({
    flush(stdout())
    cat(nonce, " ", json, "\n", sep = "")
    flush(stdout())
  })
  field <- function(line, name) {
    # A key of the server's JSON line: outside its strings every quote is
    # unescaped, inside them every quote follows a backslash.
    pat <- paste0("[{,]\"", name, "\":\"(?:[^\"\\\\]++|\\\\.)*+\"")
    m <- regmatches(line, regexpr(pat, line, perl = TRUE))
    if (length(m) == 0) return(NULL)
    s <- substr(m, nchar(name) + 6, nchar(m) - 1)
    s <- gsub("\\/", "/", s, fixed = TRUE)
    parse(text = paste0("\"", s, "\""), keep.source = FALSE)[[1]]
  }
  show <- function(v) paste(utils::capture.output(print(v)), collapse = "\n")
  run <- function(id, code, n) {
    status <- "ok"
    events <- character()
    last <- NULL
    err <- function(name, value, tb) {
      status <<- "error"
      events <<- c(events, obj(k = "error", name = name, value = value, traceback = tb))
    }
    allowInterrupts(tryCatch(
      withCallingHandlers({
        exprs <- parse(text = code, keep.source = FALSE, srcfile = NULL)
        for (e in exprs) {
          last <- withVisible(eval(e, envir = globalenv()))
        }
        if (!is.null(last) && last$visible && !is.null(last$value)) {
          assign(".Last.value", last$value, envir = globalenv())
          events <- c(events, paste0('{"k":"result","main":true,"data":{"text/plain":', esc(show(last$value)), "}}"))
        }
      },
      message = function(m) {
        emit(obj(k = "stderr", text = conditionMessage(m)))
        invokeRestart("muffleMessage")
      },
      warning = function(w) {
        emit(obj(k = "stderr", text = paste0("Warning message:\n", conditionMessage(w), "\n")))
        invokeRestart("muffleWarning")
      }),
      interrupt = function(i) err("Interrupt", "interrupted", ""),
      error = function(e) {
        call <- conditionCall(e)
        if (identical(call, quote(eval(e, envir = globalenv())))) call <- NULL
        tb <- paste0("Error", if (!is.null(call)) paste0(" in ", paste(deparse(call), collapse = " ")) else "",
                     ": ", conditionMessage(e))
        err(class(e)[1], conditionMessage(e), tb)
      }))
    flush(stdout())
    for (ev in events) emit(ev)
    emit(obj(k = "end", id = id, status = status))
  }
  emit(obj(k = "ready", pid = Sys.getpid(), language = "r"))
  n <- 0
  # Interrupts are held but while the code runs (allowInterrupts in run):
  # elsewhere one would end the driver or cut a protocol line.
  suspendInterrupts(repeat {
    line <- readLines(con, n = 1)
    if (length(line) == 0) break
    # One that came while no run was in progress is not for this run.
    tryCatch(allowInterrupts(Sys.sleep(0)), interrupt = function(i) NULL)
    id <- tryCatch(field(line, "id"), error = function(e) NULL)
    code <- tryCatch(field(line, "code"), error = function(e) NULL)
    if (is.null(id) || is.null(code)) next
    n <- n + 1
    tryCatch(run(id, code, n), interrupt = function(i) {
      emit(obj(k = "error", name = "Interrupt", value = "interrupted", traceback = ""))
      emit(obj(k = "end", id = id, status = "error"))
    })
  })
})
