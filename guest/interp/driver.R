# The interpreter driver for R contexts (crates/server/src/interpreter.rs).
# Started as `stdbuf -oL Rscript --vanilla -e 'eval(parse(text = commandArgs(TRUE)[1]))' DRIVER`
# (line-buffered stdout, so output streams while a cell runs); the first stdin
# line is a per-process nonce, each later line one run {"id","code"}. Code is
# evaluated expression by expression in the global environment, so state
# persists. Protocol lines go to stdout as `NONCE {json}`; fd 1 is a FIFO
# read by a forked relay, so what the code (or a child process) prints
# travels as `stdout` events and cannot forge or break a protocol line;
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
  # What starts the driver's protocol lines on fd 1: the nonce, or the relay's
  # mark (below).
  mark <- paste0(nonce, " ")
  emit <- function(json) suspendInterrupts({
    flush(stdout())
    cat(mark, json, "\n", sep = "")
    flush(stdout())
  })
  # Output. The code's output and the protocol lines share stdout, and the
  # server takes a line for a protocol line when it starts with the nonce:
  # output without a final newline (`cat("x")`) would glue the next protocol
  # line to itself, and a line printed with the nonce (by the code or a child
  # process) would pass for one. So fd 1 becomes a FIFO that a forked relay
  # reads: it sends what comes as `stdout` events, and passes the driver's
  # own lines, which start with a secret mark, on as protocol lines. Without
  # /proc or FIFOs, output goes to stdout as it is.
  relay <- function(out, path, mark) {
    nonce_sp <- charToRaw(paste0(nonce, " "))
    markb <- charToRaw(mark)
    nl <- as.raw(10)
    ffd <- rawToChar(as.raw(c(0xef, 0xbf, 0xbd)))
    json_text <- function(b) {
      if (any(b == as.raw(0))) {  # NUL cannot be in a string
        z <- c(0, which(b == as.raw(0)), length(b) + 1)
        pieces <- vapply(seq_len(length(z) - 1), function(k)
          if (z[k + 1] - z[k] > 1) json_text(b[(z[k] + 1):(z[k + 1] - 1)]) else "", "")
        return(paste(pieces, collapse = "\\u0000"))
      }
      s <- rawToChar(b)
      if (!validUTF8(s)) s <- iconv(s, "UTF-8", "UTF-8", sub = ffd)
      for (p in list(c("\\", "\\\\"), c("\"", "\\\""), c("\n", "\\n"), c("\r", "\\r"), c("\t", "\\t")))
        s <- gsub(p[1], p[2], s, fixed = TRUE, useBytes = TRUE)
      m <- gregexpr("[\001-\010\013\014\016-\037]", s, useBytes = TRUE)
      if (m[[1]][1] > 0)
        regmatches(s, m) <- list(vapply(regmatches(s, m)[[1]], function(ch)
          sprintf("\\u%04x", as.integer(charToRaw(ch))), ""))
      s
    }
    send <- function(b) if (length(b)) {
      writeBin(c(nonce_sp, charToRaw('{"k":"stdout","text":"'), charToRaw(json_text(b)),
                 charToRaw('"}'), nl), out)
      flush(out)
    }
    # The bytes of b to keep for later: a tail that may begin the mark, and
    # before it the start of a UTF-8 sequence that has not come whole.
    held <- function(b) {
      n <- length(b)
      keep <- 0
      for (k in seq_len(min(length(markb) - 1, n))) if (identical(b[(n - k + 1):n], markb[1:k])) keep <- k
      end <- n - keep
      for (k in seq_len(min(3, end))) {
        v <- as.integer(b[end - k + 1])
        if (v < 0x80) break
        if (v >= 0xc0) {
          need <- if (v >= 0xf0) 4 else if (v >= 0xe0) 3 else 2
          if (k < need) keep <- keep + k
          break
        }
      }
      keep
    }
    r <- fifo(path, "rb", blocking = TRUE)
    unlink(path)
    buf <- raw(0)
    repeat {
      chunk <- readBin(r, "raw", 65536)
      if (!length(chunk)) break  # every writer has gone
      buf <- c(buf, chunk)
      repeat {
        i <- grepRaw(markb, buf, fixed = TRUE)
        if (!length(i)) break
        start <- i + length(markb)
        j <- if (start <= length(buf)) which(buf[start:length(buf)] == nl)[1] else NA
        if (is.na(j)) break  # the rest of the line has not come yet
        send(buf[seq_len(i - 1)])
        writeBin(c(nonce_sp, buf[start:(start + j - 1)]), out)
        flush(out)
        buf <- buf[-seq_len(start + j - 1)]
      }
      if (!length(grepRaw(markb, buf, fixed = TRUE))) {
        keep <- held(buf)
        send(buf[seq_len(length(buf) - keep)])
        buf <- buf[seq_len(keep) + length(buf) - keep]
      }
    }
    send(buf)
  }
  stdout_fifo <- NULL
  local({
    pipe <- Sys.readlink("/proc/self/fd/1")
    if (!capabilities("fifo") || !nzchar(pipe)) return()
    rnd <- file("/dev/urandom", "rb", raw = TRUE)
    secret <- paste(as.character(readBin(rnd, "raw", 16)), collapse = "")
    close(rnd)
    path <- tempfile("runtime-stdout-")
    out <- file("/proc/self/fd/1", "ab", raw = TRUE)
    flush(stdout())
    parallel:::closeStdout(FALSE)
    # The lowest free descriptor, 1, becomes the FIFO (read and write, so it
    # never blocks to open; blocking, so writers wait when it is full).
    f <- tryCatch(fifo(path, "w+b", blocking = TRUE), error = function(e) NULL)
    if (is.null(f) || Sys.readlink("/proc/self/fd/1") != normalizePath(path)) {
      # Put stdout back: the lowest free descriptor again.
      if (!is.null(f)) close(f)
      fds <- list.files("/proc/self/fd", full.names = TRUE)
      stdout_fifo <<- file(fds[which(Sys.readlink(fds) == pipe)[1]], "ab", raw = TRUE)
      close(out)
      return()
    }
    child <- parallel:::mcfork(estranged = TRUE)
    if (inherits(child, "masterProcess")) {
      parallel:::closeStdout(TRUE)  # not a writer of the FIFO itself
      suspendInterrupts(tryCatch(relay(out, path, paste0("\001", secret, "\002")),
                                 error = function(e) NULL))
      parallel:::mcexit(0L)
    }
    close(out)
    stdout_fifo <<- f  # open for the driver's life
    mark <<- paste0("\001", secret, "\002")
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
