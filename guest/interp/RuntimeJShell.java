// The interpreter driver for Java contexts (crates/server/src/interpreter.rs).
// Run by the `java` source launcher; the first stdin line is a per-process
// nonce, each later line one run {"id","code"}. One JShell (the JDK's jshell
// engine, executing in this JVM) holds the state: each cell is cut into
// snippets with jshell's own source analysis and evaluated in order, stopping
// at the first error. Protocol lines go to the original stdout as
// `NONCE {json}`; System.out and System.err of the code become `stdout` and
// `stderr` events. SIGINT stops the running snippet (JShell.stop) and keeps
// the state; the snippets of the cell after it do not run.
import java.io.*;
import java.nio.charset.StandardCharsets;
import java.util.*;
import jdk.jshell.*;

public class RuntimeJShell {
    static final PrintStream PROTO = new PrintStream(new FileOutputStream(FileDescriptor.out), false, StandardCharsets.UTF_8);
    static String nonce = "";
    static volatile boolean running = false;
    static volatile boolean stopped = false;
    /** Guards `cell` and the changes of `running` against the SIGINT handler. */
    static final Object CELL = new Object();
    static long cell = 0;

    static String q(String s) {
        StringBuilder b = new StringBuilder("\"");
        for (int i = 0; i < s.length(); i++) {
            char c = s.charAt(i);
            switch (c) {
                case '"': b.append("\\\""); break;
                case '\\': b.append("\\\\"); break;
                case '\n': b.append("\\n"); break;
                case '\r': b.append("\\r"); break;
                case '\t': b.append("\\t"); break;
                default:
                    if (c < 0x20) b.append(String.format("\\u%04x", (int) c));
                    else b.append(c);
            }
        }
        return b.append('"').toString();
    }

    static synchronized void emit(String json) {
        PROTO.print(nonce + " " + json + "\n");
        PROTO.flush();
    }

    /** A stream whose bytes become `kind` events (decoded as UTF-8 per write). */
    static PrintStream events(String kind) {
        OutputStream o = new OutputStream() {
            final ByteArrayOutputStream buf = new ByteArrayOutputStream();
            @Override public synchronized void write(int b) { buf.write(b); if (b == '\n') flush(); }
            @Override public synchronized void write(byte[] b, int off, int len) { buf.write(b, off, len); flush(); }
            @Override public synchronized void flush() {
                if (buf.size() == 0) return;
                byte[] all = buf.toByteArray();
                int end = all.length;
                // keep an incomplete UTF-8 sequence for the next write
                int i = end - 1, back = 0;
                while (i >= 0 && back < 3 && (all[i] & 0xC0) == 0x80) { i--; back++; }
                if (i >= 0 && (all[i] & 0x80) != 0) {
                    int need = (all[i] & 0xE0) == 0xC0 ? 2 : (all[i] & 0xF0) == 0xE0 ? 3 : 4;
                    if (end - i < need) end = i;
                }
                buf.reset();
                buf.write(all, end, all.length - end);
                if (end > 0) emit("{\"k\":" + q(kind) + ",\"text\":" + q(new String(all, 0, end, StandardCharsets.UTF_8)) + "}");
            }
        };
        return new PrintStream(o, true, StandardCharsets.UTF_8);
    }

    /** The string value of `key` in the server's flat JSON object. */
    static String field(String line, String key) {
        int i = line.indexOf("\"" + key + "\":\"");
        while (i > 0 && line.charAt(i - 1) != '{' && line.charAt(i - 1) != ',') i = line.indexOf("\"" + key + "\":\"", i + 1);
        if (i < 0) return null;
        StringBuilder b = new StringBuilder();
        for (int j = i + key.length() + 4; j < line.length(); j++) {
            char c = line.charAt(j);
            if (c == '"') return b.toString();
            if (c != '\\') { b.append(c); continue; }
            char e = line.charAt(++j);
            switch (e) {
                case 'n': b.append('\n'); break;
                case 'r': b.append('\r'); break;
                case 't': b.append('\t'); break;
                case 'b': b.append('\b'); break;
                case 'f': b.append('\f'); break;
                case 'u': b.append((char) Integer.parseInt(line.substring(j + 1, j + 5), 16)); j += 4; break;
                default: b.append(e);
            }
        }
        return null;
    }

    static String errorEvent(String name, String value, String tb) {
        return "{\"k\":\"error\",\"name\":" + q(name) + ",\"value\":" + q(value) + ",\"traceback\":" + q(tb) + "}";
    }

    static String trace(Throwable t) {
        StringBuilder b = new StringBuilder();
        String name = t instanceof EvalException ? ((EvalException) t).getExceptionClassName() : t.getClass().getName();
        b.append(name);
        if (t.getMessage() != null) b.append(": ").append(t.getMessage());
        b.append('\n');
        for (StackTraceElement f : t.getStackTrace()) {
            String cls = f.getClassName();
            if (cls.startsWith("jdk.jshell.") || cls.startsWith("jdk.internal.") || cls.startsWith("java.lang.reflect.")) break;
            b.append("\tat ").append(f).append('\n');
        }
        if (t.getCause() != null) b.append("Caused by: ").append(trace(t.getCause()));
        return b.toString();
    }

    public static void main(String[] args) throws Exception {
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
        nonce = in.readLine().trim();
        System.setIn(new ByteArrayInputStream(new byte[0]));
        PrintStream out = events("stdout"), err = events("stderr");
        System.setOut(out);
        System.setErr(err);
        JShell js = JShell.builder().executionEngine("local").out(out).err(err).build();
        SourceCodeAnalysis sca = js.sourceCodeAnalysis();
        // Warm the compiler so the first cell does not pay for it alone.
        js.eval("Object $runtime_warm = null;");
        sun.misc.Signal.handle(new sun.misc.Signal("INT"), sig -> {
            long mine;
            synchronized (CELL) {
                if (!running || stopped) return;  // the first signal of the cell acts
                mine = cell;
                stopped = true;
            }
            // JShell.stop() stops only code that runs: a signal that comes while
            // a snippet is analyzed or compiled would be lost, so stop again until
            // the cell has ended.
            while (true) {
                synchronized (CELL) {
                    if (!running || cell != mine) return;
                    js.stop();
                }
                try { Thread.sleep(250); } catch (InterruptedException e) { return; }
            }
        });
        emit("{\"k\":\"ready\",\"pid\":" + ProcessHandle.current().pid() + ",\"language\":\"java\"}");
        String line;
        while ((line = in.readLine()) != null) {
            String id = field(line, "id"), code = field(line, "code");
            if (id == null || code == null) continue;
            synchronized (CELL) {
                cell++;
                stopped = false;
                running = true;
            }
            List<String> events = new ArrayList<>();
            String status = "ok";
            String value = null;
            try {
                String rest = code;
                while (!rest.isBlank()) {
                    if (stopped) {  // interrupted between two snippets
                        events.add(errorEvent("Interrupted", "stopped", ""));
                        status = "error";
                        value = null;
                        break;
                    }
                    SourceCodeAnalysis.CompletionInfo ci = sca.analyzeCompletion(rest);
                    if (ci.completeness() == SourceCodeAnalysis.Completeness.EMPTY) break;
                    String src;
                    if (ci.completeness().isComplete()) { src = ci.source(); rest = ci.remaining(); }
                    else { src = rest; rest = ""; }
                    value = null;
                    String failed = null;
                    for (SnippetEvent e : js.eval(src)) {
                        if (e.causeSnippet() != null) continue;
                        Snippet s = e.snippet();
                        if (e.status() == Snippet.Status.REJECTED) {
                            StringBuilder tb = new StringBuilder();
                            String first = null;
                            for (Diag d : (Iterable<Diag>) js.diagnostics(s)::iterator) {
                                if (!d.isError()) continue;
                                // a snippet's wrapper class has no name worth showing
                                String m = d.getMessage(Locale.ROOT).replaceAll("\\n\\s*location: class\\s*$", "");
                                if (first == null) first = m;
                                tb.append(m).append("\n    at: ").append(s.source().strip()).append('\n');
                            }
                            failed = errorEvent("CompilationError", first == null ? "rejected" : first, tb.toString());
                        } else if (e.exception() != null) {
                            JShellException x = e.exception();
                            if (stopped) failed = errorEvent("Interrupted", "stopped", "");
                            else if (x instanceof EvalException) failed = errorEvent(((EvalException) x).getExceptionClassName(),
                                String.valueOf(x.getMessage()), trace(x));
                            else if (x instanceof UnresolvedReferenceException) failed = errorEvent("UnresolvedReferenceException",
                                "unresolved references in " + ((UnresolvedReferenceException) x).getSnippet().source().strip(), "");
                            else failed = errorEvent(x.getClass().getSimpleName(), String.valueOf(x.getMessage()), trace(x));
                        } else if (s.kind() == Snippet.Kind.EXPRESSION || (s.kind() == Snippet.Kind.VAR
                                && s.subKind() == Snippet.SubKind.TEMP_VAR_EXPRESSION_SUBKIND)) {
                            value = e.value();
                        }
                    }
                    if (failed == null && stopped) failed = errorEvent("Interrupted", "stopped", "");
                    if (failed != null) { events.add(failed); status = "error"; value = null; break; }
                }
            } catch (Exception e) {
                events.add(errorEvent(e.getClass().getSimpleName(), String.valueOf(e.getMessage()), trace(e)));
                status = "error";
                value = null;
            } finally {
                synchronized (CELL) { running = false; }
            }
            out.flush();
            err.flush();
            if (value != null && !value.isEmpty())
                events.add("{\"k\":\"result\",\"main\":true,\"data\":{\"text/plain\":" + q(value) + "}}");
            for (String ev : events) emit(ev);
            emit("{\"k\":\"end\",\"id\":" + q(id) + ",\"status\":" + q(status) + "}");
        }
        System.exit(0);
    }
}
